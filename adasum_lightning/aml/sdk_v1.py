"""SDK v1 backend (``azureml-core``, extra ``aml``): a ``ScriptRunConfig``, MPI or PyTorch distribution.

SDK v1's support has ended; prefer :mod:`.sdk_v2`. Only :func:`connect`, :func:`get_or_create_cluster` and
:func:`submit` talk to Azure.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from adasum_lightning.aml.errors import AmlSubmitError, AmlUsageError, say
from adasum_lightning.aml.job import IDLE_SECONDS_BEFORE_SCALEDOWN, SHM_SIZE, AmlJob, environment_parts
from adasum_lightning.aml.project import bind_placeholders
from adasum_lightning.aml.staging import StagedJob
from adasum_lightning.aml.workspace import WorkspaceConfig, check_network, first_line, redact

#: Interpreter of the job image (the venv the Dockerfile creates).
IMAGE_PYTHON = "/opt/venv/bin/python"
#: The variable an SDK v1 run sets to the path of the data ``NAME``.
DATA_REFERENCE = "AZUREML_DATAREFERENCE_{}"


def _image_name(job: AmlJob, staged: StagedJob) -> str:
    return f"{job.environment_name}-{staged.environment_version}"  # SDK v1 numbers versions itself


def build_environment(job: AmlJob, staged: StagedJob, build_context=None):
    """The job's ``azureml.core.Environment`` with the image's Python, from ``build_context`` (uploaded by
    :func:`submit`; default: the local folder), or a reference to ``--environment``."""
    from azureml.core import Environment
    from azureml.core.environment import DockerBuildContext

    if job.environment is not None:
        name, version = environment_parts(job.environment)
        env = Environment(name)
        env.version = version
        return env
    context = build_context or DockerBuildContext(
        location=str(staged.context_dir), dockerfile_path="Dockerfile"
    )
    env = Environment.from_docker_build_context(_image_name(job, staged), context)
    env.python.user_managed_dependencies = True
    env.python.interpreter_path = IMAGE_PYTHON
    return env


def build_data(job: AmlJob) -> tuple[dict, dict]:
    """``(run_config.data, run_config.output_data)``: one entry per ``--input`` and per ``--output``."""
    from azureml.core.runconfig import Data, DataLocation, DataPath, OutputData, Uri
    from azureml.core.runconfig import Dataset as RunDataset

    inputs, outputs = {}, {}
    for binding in job.data:
        if binding.datastore_path is not None:
            store, path = binding.datastore_path
            location = DataLocation(data_path=DataPath(datastore_name=store, relative_path=path))
        elif binding.asset is not None:
            name, version = binding.asset
            location = DataLocation(dataset=RunDataset(dataset_name=name, dataset_version=version))
        else:
            location = DataLocation(uri=Uri(path=binding.uri, is_file=binding.type == "uri_file"))
        mount = binding.mode in ("ro_mount", "rw_mount")
        if binding.direction == "inputs":
            variable = DATA_REFERENCE.format(binding.name)
            mechanism = "mount" if mount else "download"
            inputs[binding.name] = Data(
                data_location=location, mechanism=mechanism, environment_variable_name=variable
            )
        else:
            outputs[binding.name] = OutputData(
                output_location=location, mechanism="mount" if mount else "upload"
            )
    return inputs, outputs


def build_script_run_config(job: AmlJob, code_dir: Path, environment):
    """The job as an ``azureml.core.ScriptRunConfig`` on ``job.compute_name``, its placeholders bound to
    the data references; ``MpiConfiguration`` for the Horovod strategies, ``PyTorchConfiguration`` (NCCL,
    ``process_count`` the job's total) for ``ddp_adasum``."""
    from azureml.core import ScriptRunConfig
    from azureml.core.runconfig import DockerConfiguration, MpiConfiguration, PyTorchConfiguration

    paths = {(b.direction, b.name): "$" + DATA_REFERENCE.format(b.name) for b in job.data}
    command = bind_placeholders(job.training_command(), paths)
    if job.is_mpi:
        distribution = MpiConfiguration(
            process_count_per_node=job.process_count_per_node, node_count=job.node_count
        )
    else:
        distribution = PyTorchConfiguration(
            communication_backend="Nccl", process_count=job.world_size, node_count=job.node_count
        )
    src = ScriptRunConfig(
        source_directory=str(code_dir),
        script=command[1],
        arguments=command[2:],
        compute_target=job.compute_name,
        environment=environment,
        distributed_job_config=distribution,
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

    tenant, client, secret = (
        os.environ.get(n) for n in ("AZURE_TENANT_ID", "AZURE_CLIENT_ID", "AZURE_CLIENT_SECRET")
    )
    if tenant and client and secret:
        return ServicePrincipalAuthentication(tenant, client, secret)
    return AzureCliAuthentication()


def connect(config: WorkspaceConfig, *, auth_factory: Callable | None = None):
    """The ``azureml.core.Workspace`` named by ``config``, authenticated without an interactive login, after
    :func:`.workspace.check_network` (an offline machine fails in seconds).

    Raises:
        AmlSubmitError: no network, authentication failed or the workspace was not found (credentials
            redacted).
    """
    check_network()
    from azureml.core import Workspace

    try:
        auth = (auth_factory or _auth)()
        return Workspace(config.subscription_id, config.resource_group, config.workspace_name, auth=auth)
    except Exception as err:  # the SDK raises many types (auth, HTTP, ProjectSystemException)
        raise AmlSubmitError(
            f"cannot open workspace {config.workspace_name!r} (resource group {config.resource_group!r}) "
            f"with SDK v1: {first_line(err)}. Log in with `az login` (or set AZURE_TENANT_ID, "
            f"AZURE_CLIENT_ID, AZURE_CLIENT_SECRET) and check {config.source or 'the config file'}"
        ) from err


def get_or_create_cluster(workspace, job: AmlJob):
    """The AmlCompute cluster ``job.compute_name``, created with the job's VM size and bounds when absent."""
    from azureml.core.compute import AmlCompute, ComputeTarget
    from azureml.core.compute_target import ComputeTargetException

    try:
        target = ComputeTarget(workspace=workspace, name=job.compute_name)
    except ComputeTargetException:
        target = None
    if target is not None:
        vm_size = str(getattr(target, "vm_size", "") or "")
        max_nodes = getattr(getattr(target, "scale_settings", None), "maximum_node_count", None)
        job.check_existing_cluster(vm_size, max_nodes, str(getattr(target, "vm_priority", "") or ""))
        say(f"using the existing cluster {job.compute_name} ({vm_size})")
        return target
    say(f"creating the cluster {job.compute_name}: {job.vm_size}, {job.cluster_nodes}")
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


def resolve_environment(workspace, job: AmlJob, staged: StagedJob, upload_build_context: bool = True):
    """The run's environment: the registered ``--environment`` (refused when absent), an image of the same
    content, or a new one built with the run (its build context uploaded unless ``upload_build_context`` is
    False)."""
    from azureml.core import Environment
    from azureml.core.environment import DockerBuildContext

    if job.environment is not None:
        name, version = environment_parts(job.environment)
        try:
            env = Environment.get(workspace, name, version=version)
        except Exception as err:  # the SDK raises a generic exception for an unknown name or version
            raise AmlUsageError(
                f"--environment {job.environment}: the workspace has no such environment "
                f"({first_line(err)}). List them in Azure ML studio, or drop --environment to let adasum-aml "
                "build one"
            ) from None
        say(f"using the registered environment {env.name}:{env.version}")
        return env
    name = _image_name(job, staged)
    try:
        env = Environment.get(workspace, name)
    except Exception:  # not registered yet
        say(f"new environment {name}: Azure ML builds it with this run")
        if not upload_build_context:
            return build_environment(job, staged)
        context = DockerBuildContext.from_local_directory(workspace, str(staged.context_dir), "Dockerfile")
        return build_environment(job, staged, context)
    say(f"reusing the environment {name} (same content as an earlier submit)")
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
    """Submit ``job`` to ``workspace`` (default: :func:`connect` to ``config``) with ``experiment_factory``
    (default ``azureml.core.Experiment``) after its cluster and environment (:func:`resolve_environment`).

    Returns:
        ``(the submitted azureml.core.Run, its final status or None without stream)``.
    """
    from azureml.core import Experiment

    workspace = workspace if workspace is not None else connect(config)
    get_or_create_cluster(workspace, job)
    environment = resolve_environment(workspace, job, staged, upload_build_context)
    try:
        experiment = (experiment_factory or Experiment)(workspace, job.experiment_name)
        run = experiment.submit(build(job, staged, environment=environment))
    except Exception as err:
        raise AmlSubmitError(f"SDK v1 submission failed: {redact(str(err))}") from err
    say(f"submitted run {run.id}: {run.get_portal_url()}")
    if not stream:
        return run, None
    try:
        status = run.wait_for_completion(show_output=True, raise_on_error=False).get("status")
    except Exception as err:
        raise AmlSubmitError(f"following run {run.id} failed: {redact(str(err))}") from err
    say(f"run {run.id} ended: {status}")
    return run, status
