"""SDK v1 backend (``azureml-core``, extra ``aml``): a ``ScriptRunConfig``, MPI or PyTorch distribution.

SDK v1's support ended on 2026-06-30; prefer :mod:`.sdk_v2`. Everything works offline except :func:`connect`,
:func:`get_or_create_cluster` and :func:`submit`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from adasum_lightning.aml.errors import AmlSubmitError, AmlUsageError
from adasum_lightning.aml.job import (
    IDLE_SECONDS_BEFORE_SCALEDOWN,
    SHM_SIZE,
    AmlJob,
    environment_parts,
)
from adasum_lightning.aml.project import bind_placeholders
from adasum_lightning.aml.staging import StagedJob
from adasum_lightning.aml.workspace import WorkspaceConfig, check_network, redact

#: Interpreter of the job image (the venv the Dockerfile creates).
IMAGE_PYTHON = "/opt/venv/bin/python"


def environment_name(job: AmlJob, staged: StagedJob) -> str:
    """``adasum-lightning-horovod-nccl-<content version>``: SDK v1 numbers versions itself."""
    return f"{job.environment_name}-{staged.environment_version}"


def build_environment(job: AmlJob, staged: StagedJob, build_context=None):
    """The job's ``azureml.core.Environment``, with user-managed Python (the image's venv).

    Args:
        job: the job description.
        staged: the staged folders (:func:`.staging.stage_job`).
        build_context: a ``DockerBuildContext`` uploaded to the workspace (by :func:`submit`); ``None``
            (offline) refers to the local folder. Unused for ``--environment``, which :func:`submit` fetches.
    """
    from azureml.core import Environment
    from azureml.core.environment import DockerBuildContext

    if job.environment is not None:
        name, version = environment_parts(job.environment)
        env = Environment(name)
        env.version = version
        return env
    if build_context is None:
        build_context = DockerBuildContext(location=str(staged.context_dir), dockerfile_path="Dockerfile")
    env = Environment.from_docker_build_context(environment_name(job, staged), build_context)
    env.python.user_managed_dependencies = True
    env.python.interpreter_path = IMAGE_PYTHON
    return env


def data_reference(name: str) -> str:
    """``$AZUREML_DATAREFERENCE_<name>``, which an SDK v1 run replaces by the path of the data ``name``."""
    return f"$AZUREML_DATAREFERENCE_{name}"


def build_data(job: AmlJob) -> tuple[dict, dict]:
    """``(run_config.data, run_config.output_data)``: one entry per ``--input`` and per ``--output``."""
    from azureml.core.runconfig import Data, DataLocation, DataPath, OutputData, Uri
    from azureml.core.runconfig import Dataset as RunDataset

    inputs, outputs = {}, {}
    for binding in job.data:
        store = binding.datastore_path
        if store is not None:
            location = DataLocation(data_path=DataPath(datastore_name=store[0], relative_path=store[1]))
        elif binding.asset is not None:
            name, version = binding.asset
            location = DataLocation(dataset=RunDataset(dataset_name=name, dataset_version=version))
        else:
            location = DataLocation(uri=Uri(path=binding.uri, is_file=binding.type == "uri_file"))
        if binding.direction == "inputs":
            inputs[binding.name] = Data(
                data_location=location,
                mechanism="mount" if binding.mode == "ro_mount" else "download",
                environment_variable_name=data_reference(binding.name)[1:],
            )
        else:
            outputs[binding.name] = OutputData(
                output_location=location, mechanism="mount" if binding.mode == "rw_mount" else "upload"
            )
    return inputs, outputs


def build_distributed_job_config(job: AmlJob):
    """``MpiConfiguration`` for the Horovod strategies, ``PyTorchConfiguration`` (NCCL) for ``ddp_adasum``.

    ``PyTorchConfiguration``'s ``process_count`` is the job's total, not per node.
    """
    from azureml.core.runconfig import MpiConfiguration, PyTorchConfiguration

    if job.is_mpi:
        return MpiConfiguration(process_count_per_node=job.process_count_per_node, node_count=job.node_count)
    return PyTorchConfiguration(
        communication_backend="Nccl", process_count=job.world_size, node_count=job.node_count
    )


def build_script_run_config(job: AmlJob, code_dir: Path, environment):
    """The job as an ``azureml.core.ScriptRunConfig`` on the cluster ``job.compute_name``.

    Args:
        job: the job description.
        code_dir: the staged code snapshot (the run's source directory).
        environment: from :func:`build_environment`.
    """
    from azureml.core import ScriptRunConfig
    from azureml.core.runconfig import DockerConfiguration

    paths = {(b.direction, b.name): data_reference(b.name) for b in job.data}
    command = bind_placeholders(job.training_command(), paths)
    src = ScriptRunConfig(
        source_directory=str(code_dir),
        script=command[1],
        arguments=command[2:],
        compute_target=job.compute_name,
        environment=environment,
        distributed_job_config=build_distributed_job_config(job),
        docker_runtime_config=DockerConfiguration(use_docker=True, shm_size=SHM_SIZE),
    )
    src.run_config.environment_variables = dict(job.environment_variables)
    src.run_config.data, src.run_config.output_data = build_data(job)
    return src


def build(job: AmlJob, staged: StagedJob, build_context=None, environment=None):
    """:func:`build_script_run_config` with ``environment`` (default :func:`build_environment`, offline)."""
    if environment is None:
        environment = build_environment(job, staged, build_context)
    return build_script_run_config(job, staged.code_dir, environment)


def run_configuration(src) -> dict:
    """The run configuration of ``src`` (script, arguments, distribution, environment), JSON-ready."""
    from azureml.core.script_run_config import get_run_config_from_script_run

    return json.loads(repr(get_run_config_from_script_run(src)))


def render(src) -> str:
    """:func:`run_configuration` as indented JSON text (what ``--dry-run --sdk v1`` prints)."""
    return json.dumps(run_configuration(src), indent=2)


def _auth():
    """Non-interactive authentication: a service principal from ``AZURE_CLIENT_*``, else ``az login``'s."""
    from azureml.core.authentication import AzureCliAuthentication, ServicePrincipalAuthentication

    names = ("AZURE_TENANT_ID", "AZURE_CLIENT_ID", "AZURE_CLIENT_SECRET")
    if all(os.environ.get(n) for n in names):
        tenant, client, secret = (os.environ[n] for n in names)
        return ServicePrincipalAuthentication(
            tenant_id=tenant, service_principal_id=client, service_principal_password=secret
        )
    return AzureCliAuthentication()


def connect(config: WorkspaceConfig, *, auth_factory: Callable | None = None):
    """The ``azureml.core.Workspace`` named by ``config``, authenticated without an interactive login.

    The network is checked first (:func:`.workspace.check_network`), so an offline machine fails in seconds.

    Raises:
        AmlSubmitError: no network, authentication failed (run ``az login`` or set a service principal), or
            the workspace was not found; credentials are redacted.
    """
    check_network()
    from azureml.core import Workspace

    try:
        auth = (auth_factory or _auth)()
        return Workspace(config.subscription_id, config.resource_group, config.workspace_name, auth=auth)
    except Exception as err:  # the SDK raises many types (auth, HTTP, ProjectSystemException)
        raise AmlSubmitError(
            f"cannot open workspace {config.workspace_name!r} (resource group {config.resource_group!r}) "
            f"with SDK v1: {redact(str(err).splitlines()[0] if str(err) else type(err).__name__)}. "
            "Log in with `az login` (or set AZURE_TENANT_ID, AZURE_CLIENT_ID, AZURE_CLIENT_SECRET) and check "
            f"{config.source or 'the config file'}"
        ) from err


def get_or_create_cluster(workspace, job: AmlJob):
    """The AmlCompute cluster ``job.compute_name``, created with the job's VM size and bounds when absent.

    Raises:
        AmlUsageError: a cluster of that name has another VM size or too few maximum nodes (the message names
            both fixes: a new ``--cluster`` name, or the matching ``--vm-size``).
    """
    from azureml.core.compute import AmlCompute, ComputeTarget
    from azureml.core.compute_target import ComputeTargetException

    try:
        target = ComputeTarget(workspace=workspace, name=job.compute_name)
    except ComputeTargetException:
        target = None
    if target is not None:
        vm_size = str(getattr(target, "vm_size", "") or "")
        max_nodes = getattr(getattr(target, "scale_settings", None), "maximum_node_count", None)
        _check_existing(job, vm_size, max_nodes)
        job.check_cluster_priority(str(getattr(target, "vm_priority", "") or ""))
        print(f"[adasum-aml] using the existing cluster {job.compute_name} ({vm_size})", flush=True)
        return target
    print(
        f"[adasum-aml] creating the cluster {job.compute_name}: {job.vm_size}, "
        f"{job.min_nodes}–{job.max_nodes} {'low-priority ' if job.low_priority else ''}nodes",
        flush=True,
    )
    config = AmlCompute.provisioning_configuration(
        vm_size=job.vm_size,
        vm_priority="lowpriority" if job.low_priority else "dedicated",
        min_nodes=job.min_nodes,
        max_nodes=job.max_nodes,
        idle_seconds_before_scaledown=IDLE_SECONDS_BEFORE_SCALEDOWN,
    )
    target = ComputeTarget.create(workspace, job.compute_name, config)
    target.wait_for_completion(show_output=True)
    return target


def _check_existing(job: AmlJob, vm_size: str, max_nodes) -> None:
    if vm_size and vm_size.lower() != job.vm_size.lower():
        raise AmlUsageError(
            f"the cluster {job.compute_name} exists with VM size {vm_size}, not {job.vm_size}. Pass "
            f"--vm-size {vm_size}, or --cluster NEW_NAME to create a {job.vm_size} cluster"
        )
    if isinstance(max_nodes, int) and max_nodes < job.node_count:
        raise AmlUsageError(
            f"the cluster {job.compute_name} scales to {max_nodes} nodes, fewer than --nodes "
            f"{job.node_count}. Raise its maximum in Azure ML studio, or pass --nodes {max_nodes} or a new "
            "--cluster name"
        )


def resolve_environment(workspace, job: AmlJob, staged: StagedJob, upload_build_context: bool = True):
    """The run's environment: the registered ``--environment``, an image of the same content, or a new one.

    A new one is built from the build context (uploaded unless ``upload_build_context`` is False) and
    registered with the run.

    Raises:
        AmlUsageError: ``--environment`` names an environment the workspace does not have.
    """
    from azureml.core import Environment
    from azureml.core.environment import DockerBuildContext

    if job.environment is not None:
        name, version = environment_parts(job.environment)
        try:
            env = Environment.get(workspace, name, version=version)
        except Exception as err:  # the SDK raises a generic exception for an unknown name or version
            raise AmlUsageError(
                f"--environment {job.environment}: the workspace has no such environment "
                f"({redact(str(err).splitlines()[0] if str(err) else type(err).__name__)}). List them in "
                "Azure ML studio, or drop --environment to let adasum-aml build one"
            ) from None
        print(f"[adasum-aml] using the registered environment {env.name}:{env.version}", flush=True)
        return env
    name = environment_name(job, staged)
    try:
        env = Environment.get(workspace, name)
    except Exception:  # not registered yet
        context = (
            DockerBuildContext.from_local_directory(workspace, str(staged.context_dir), "Dockerfile")
            if upload_build_context
            else None
        )
        print(f"[adasum-aml] new environment {name}: Azure ML builds it with this run", flush=True)
        return build_environment(job, staged, context)
    print(f"[adasum-aml] reusing the environment {name} (same content as an earlier submit)", flush=True)
    return env


def submit(
    job: AmlJob,
    staged: StagedJob,
    config: WorkspaceConfig,
    *,
    workspace=None,
    experiment_factory: Callable | None = None,
    upload_build_context: bool = True,
    stream: bool = False,
):
    """Submit ``job``: connect, get or create the cluster, resolve its environment, ``Experiment.submit``.

    Args:
        job, staged, config: what to run, its staged folders, where.
        workspace: an ``azureml.core.Workspace`` (default: :func:`connect` to ``config``).
        experiment_factory: ``(workspace, name) -> Experiment`` (default ``azureml.core.Experiment``).
        upload_build_context: upload the build context to the workspace storage; ``False`` keeps the local
            reference.
        stream: follow the run's logs until it ends.

    Returns:
        ``(the submitted azureml.core.Run, its final status or None without stream)``; its URL is printed.

    Raises:
        AmlSubmitError: see :func:`connect`; Azure errors while submitting (redacted).
        AmlUsageError: see :func:`get_or_create_cluster`, :func:`resolve_environment`.
    """
    from azureml.core import Experiment

    workspace = workspace if workspace is not None else connect(config)
    get_or_create_cluster(workspace, job)
    environment = resolve_environment(workspace, job, staged, upload_build_context)
    try:
        src = build(job, staged, environment=environment)
        experiment = (experiment_factory or Experiment)(workspace, job.experiment_name)
        run = experiment.submit(src)
    except AmlUsageError:
        raise
    except Exception as err:
        raise AmlSubmitError(f"SDK v1 submission failed: {redact(str(err))}") from err
    print(f"[adasum-aml] submitted run {run.id}: {run.get_portal_url()}", flush=True)
    if not stream:
        return run, None
    try:
        status = run.wait_for_completion(show_output=True, raise_on_error=False).get("status")
    except Exception as err:
        raise AmlSubmitError(f"following run {run.id} failed: {redact(str(err))}") from err
    print(f"[adasum-aml] run {run.id} ended: {status}", flush=True)
    return run, status
