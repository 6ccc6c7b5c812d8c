"""SDK v1 backend (``azureml-core``): ``Environment`` + ``ScriptRunConfig`` with ``MpiConfiguration`` (Horovod
strategies) or ``PyTorchConfiguration`` (``ddp_adasum``).

Install with ``pip install 'adasum-lightning[aml]'``. SDK v1 was deprecated on 2025-03-31 and its support
ended on 2026-06-30; prefer :mod:`.sdk_v2`. Every function that builds objects works offline; only
:func:`connect`, :func:`get_or_create_cluster` and :func:`submit` talk to Azure.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from adasum_lightning.aml.job import (
    IDLE_SECONDS_BEFORE_SCALEDOWN,
    AmlJob,
    AmlSubmitError,
    AmlUsageError,
)
from adasum_lightning.aml.staging import StagedJob
from adasum_lightning.aml.workspace import WorkspaceConfig, check_network, redact

#: Interpreter of the job image (the venv the Dockerfile creates).
IMAGE_PYTHON = "/opt/venv/bin/python"
SHM_SIZE = "16g"


def build_environment(job: AmlJob, context_dir: Path, build_context=None):
    """The job's ``azureml.core.Environment``, built from the Docker build context.

    Args:
        job: the job description.
        context_dir: the staged build context (:func:`.staging.stage_build_context`).
        build_context: a ``DockerBuildContext`` already uploaded to the workspace
            (``DockerBuildContext.from_local_directory``, done by :func:`submit`); ``None`` (offline) refers
            to the local folder.

    Returns:
        ``azureml.core.Environment`` with user-managed Python (the image's venv).
    """
    from azureml.core import Environment
    from azureml.core.environment import DockerBuildContext

    if build_context is None:
        build_context = DockerBuildContext(location=str(context_dir), dockerfile_path="Dockerfile")
    env = Environment.from_docker_build_context(job.environment_name, build_context)
    env.python.user_managed_dependencies = True
    env.python.interpreter_path = IMAGE_PYTHON
    return env


def build_distributed_job_config(job: AmlJob):
    """``MpiConfiguration(process_count_per_node, node_count)`` for the Horovod strategies (Azure ML's
    ``mpirun``); ``PyTorchConfiguration(process_count=nodes × per node, node_count=nodes)`` with the NCCL
    backend for ``ddp_adasum`` (Azure ML starts the processes and sets the ``torch.distributed`` variables,
    see :data:`.job.AML_PYTORCH_VARIABLES`; ``process_count`` is the job's total, not per node)."""
    from azureml.core.runconfig import MpiConfiguration, PyTorchConfiguration

    if job.is_mpi:
        return MpiConfiguration(process_count_per_node=job.process_count_per_node, node_count=job.node_count)
    return PyTorchConfiguration(
        communication_backend="Nccl", process_count=job.world_size, node_count=job.node_count
    )


def build_script_run_config(job: AmlJob, code_dir: Path, environment):
    """The job as an ``azureml.core.ScriptRunConfig``: ``job.node_count`` nodes ×
    ``job.process_count_per_node`` processes on the cluster ``job.compute_name``
    (:func:`build_distributed_job_config`).

    Args:
        job: the job description.
        code_dir: the staged code snapshot (the run's source directory).
        environment: from :func:`build_environment`.
    """
    from azureml.core import ScriptRunConfig
    from azureml.core.runconfig import DockerConfiguration

    command = job.training_command()
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
    return src


def build(job: AmlJob, staged: StagedJob, build_context=None):
    """:func:`build_script_run_config` with :func:`build_environment` for the staged folders (offline)."""
    return build_script_run_config(
        job, staged.code_dir, build_environment(job, staged.context_dir, build_context)
    )


def run_configuration(src) -> dict:
    """The full run configuration of ``src`` (script, arguments, MPI, environment) as a JSON-ready dict,
    via ``azureml.core.script_run_config.get_run_config_from_script_run``."""
    from azureml.core.script_run_config import get_run_config_from_script_run

    return json.loads(repr(get_run_config_from_script_run(src)))


def render(src) -> str:
    """:func:`run_configuration` as indented JSON text (what ``--dry-run --sdk v1`` prints)."""
    return json.dumps(run_configuration(src), indent=2)


def _auth():
    """Non-interactive authentication: a service principal from ``AZURE_CLIENT_ID``/``AZURE_TENANT_ID``/
    ``AZURE_CLIENT_SECRET`` when set, else the Azure CLI's login (``az login``). Never a browser prompt."""
    from azureml.core.authentication import AzureCliAuthentication, ServicePrincipalAuthentication

    names = ("AZURE_TENANT_ID", "AZURE_CLIENT_ID", "AZURE_CLIENT_SECRET")
    if all(os.environ.get(n) for n in names):
        tenant, client, secret = (os.environ[n] for n in names)
        return ServicePrincipalAuthentication(
            tenant_id=tenant, service_principal_id=client, service_principal_password=secret
        )
    return AzureCliAuthentication()


def connect(config: WorkspaceConfig, *, auth_factory: Callable | None = None):
    """The ``azureml.core.Workspace`` named by ``config``, authenticated without any interactive login.

    Checks the network first (:func:`.workspace.check_network`), so an offline machine fails in seconds
    before any credential is created.

    Raises:
        AmlSubmitError: no network, authentication failed (run ``az login`` or set a service principal), or
            the workspace was not found. Messages are redacted of credentials.
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
    """The AmlCompute cluster ``job.compute_name``, created (min ``job.min_nodes``, max ``job.max_nodes``
    nodes of ``job.vm_size``, scale-down after :data:`IDLE_SECONDS_BEFORE_SCALEDOWN` s) when absent.

    Raises:
        AmlUsageError: a cluster of that name exists with another VM size or too few maximum nodes (the
            message names both fixes: ``--cluster`` with a new name, or matching ``--vm-size``).
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
        print(f"[adasum-aml] using the existing cluster {job.compute_name} ({vm_size})", flush=True)
        return target
    print(
        f"[adasum-aml] creating the cluster {job.compute_name}: {job.vm_size}, "
        f"{job.min_nodes}–{job.max_nodes} nodes",
        flush=True,
    )
    config = AmlCompute.provisioning_configuration(
        vm_size=job.vm_size,
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


def submit(
    job: AmlJob,
    staged: StagedJob,
    config: WorkspaceConfig,
    *,
    workspace=None,
    experiment_factory: Callable | None = None,
    upload_build_context: bool = True,
):
    """Submit ``job``: connect, get or create the cluster, upload the build context, ``Experiment.submit``.

    Args:
        job, staged, config: what to run, its staged folders, where.
        workspace: an ``azureml.core.Workspace`` (default: :func:`connect` to ``config``).
        experiment_factory: ``(workspace, name) -> Experiment`` (default ``azureml.core.Experiment``).
        upload_build_context: upload the build context to the workspace storage
            (``DockerBuildContext.from_local_directory``); ``False`` keeps the local reference.

    Returns:
        The submitted ``azureml.core.Run``; its portal URL is printed.

    Raises:
        AmlSubmitError: see :func:`connect`; Azure errors while submitting (redacted).
        AmlUsageError: see :func:`get_or_create_cluster`.
    """
    from azureml.core import Experiment
    from azureml.core.environment import DockerBuildContext

    workspace = workspace if workspace is not None else connect(config)
    get_or_create_cluster(workspace, job)
    try:
        context = (
            DockerBuildContext.from_local_directory(workspace, str(staged.context_dir), "Dockerfile")
            if upload_build_context
            else None
        )
        src = build(job, staged, context)
        experiment = (experiment_factory or Experiment)(workspace, job.experiment_name)
        run = experiment.submit(src)
    except AmlUsageError:
        raise
    except Exception as err:
        raise AmlSubmitError(f"SDK v1 submission failed: {redact(str(err))}") from err
    print(f"[adasum-aml] submitted run {run.id}: {run.get_portal_url()}", flush=True)
    return run
