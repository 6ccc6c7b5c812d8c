"""SDK v2 backend (``azure-ai-ml`` + ``azure-identity``, extra ``aml-v2``): ``command(...)``, MPI or PyTorch.

Building the job works offline; only :func:`connect`, :func:`get_or_create_cluster` and :func:`submit` talk to
Azure.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path

from adasum_lightning.aml.errors import AmlSubmitError, AmlUsageError, say
from adasum_lightning.aml.job import IDLE_SECONDS_BEFORE_SCALEDOWN, SHM_SIZE, AmlJob, environment_parts
from adasum_lightning.aml.staging import StagedJob
from adasum_lightning.aml.workspace import WorkspaceConfig, check_network, first_line, redact

_DISPLAY_NAMES = {"horovod_adasum": "adasum", "horovod": "horovod", "ddp_adasum": "ddp-adasum"}


def build_environment(job: AmlJob, staged: StagedJob):
    """The job's environment: ``--environment``'s reference, else an ``Environment`` built from the
    context, named :attr:`.job.AmlJob.environment_name`, versioned by :func:`.staging.content_version`."""
    from azure.ai.ml.entities import BuildContext, Environment

    if job.environment is not None:
        return job.environment
    description = (
        f"OpenMPI + CUDA ({job.base_image}), torch, Horovod with NCCL compiled with the registry's CUDA "
        "wheels (patches/build_horovod.sh --gpu)"
        if job.is_mpi
        else f"CUDA runtime ({job.base_image}), torch with NCCL; no MPI, no Horovod (ddp_adasum)"
    )
    build = BuildContext(path=str(staged.context_dir), dockerfile_path="Dockerfile")
    return Environment(
        name=job.environment_name, version=staged.environment_version, description=description, build=build
    )


def build(job: AmlJob, staged: StagedJob, environment=None):
    """The job as an ``azure.ai.ml.entities.CommandJob`` on the cluster ``job.compute_name``: an ``Input`` per
    ``--input``, an ``Output`` per ``--output``, ``MpiDistribution`` for the Horovod strategies,
    ``PyTorchDistribution`` for ``ddp_adasum``.

    Args:
        environment: what the job runs in (default :func:`build_environment`; :func:`submit` passes the
            reference of an environment that exists).
    """
    from azure.ai.ml import Input, MpiDistribution, Output, PyTorchDistribution, command

    data = {"inputs": {}, "outputs": {}}
    for b in job.data:
        data[b.direction][b.name] = (Input if b.direction == "inputs" else Output)(
            type=b.type, path=b.uri, mode=b.mode
        )
    distribution = (MpiDistribution if job.is_mpi else PyTorchDistribution)(
        process_count_per_instance=job.process_count_per_node
    )
    name = Path(job.script_name).stem.replace("_", "-")
    node = command(
        code=str(staged.code_dir),
        command=job.command_line(),
        inputs=data["inputs"] or None,
        outputs=data["outputs"] or None,
        environment=environment if environment is not None else build_environment(job, staged),
        environment_variables=dict(job.environment_variables),
        compute=job.compute_name,
        instance_count=job.node_count,
        distribution=distribution,
        shm_size=SHM_SIZE,
        experiment_name=job.experiment_name,
        display_name=f"{name}-{_DISPLAY_NAMES[job.strategy]}-{job.node_count}x{job.process_count_per_node}",
        tags={"vm_size": job.vm_size, "world_size": str(job.world_size), "strategy": job.strategy},
    )
    # The standalone job (not the pipeline-node form of the builder): what jobs.create_or_update submits.
    return node._to_job()


def render(job_entity) -> str:
    """The job as Azure ML job YAML (``azure.ai.ml.load_job`` reads it), as ``--dry-run --sdk v2`` prints."""
    stream = io.StringIO()
    job_entity.dump(stream)
    return stream.getvalue()


def connect(config: WorkspaceConfig, *, credential_factory: Callable | None = None):
    """An ``azure.ai.ml.MLClient`` for the workspace in ``config``, after :func:`.workspace.check_network`;
    the default credential is ``DefaultAzureCredential`` without its interactive browser step.

    Raises:
        AmlSubmitError: no network.
    """
    check_network()
    from azure.ai.ml import MLClient

    if credential_factory is None:
        from azure.identity import DefaultAzureCredential

        credential = DefaultAzureCredential(exclude_interactive_browser_credential=True)
    else:
        credential = credential_factory()
    return MLClient(credential, config.subscription_id, config.resource_group, config.workspace_name)


def get_or_create_cluster(client, job: AmlJob):
    """The AmlCompute cluster ``job.compute_name``, created with the job's VM size and bounds when absent."""
    from azure.ai.ml.entities import AmlCompute
    from azure.core.exceptions import ResourceNotFoundError

    try:
        existing = client.compute.get(job.compute_name)
    except ResourceNotFoundError:
        existing = None
    if existing is not None:
        size = str(getattr(existing, "size", "") or "")
        tier = str(getattr(existing, "tier", "") or "")
        job.check_existing_cluster(size, getattr(existing, "max_instances", None), tier)
        say(f"using the existing cluster {job.compute_name} ({size})")
        return existing
    say(f"creating the cluster {job.compute_name}: {job.vm_size}, {job.cluster_nodes}")
    cluster = AmlCompute(
        name=job.compute_name,
        size=job.vm_size,
        min_instances=job.min_nodes,
        max_instances=job.max_nodes,
        idle_time_before_scale_down=IDLE_SECONDS_BEFORE_SCALEDOWN,
        tier="low_priority" if job.low_priority else "dedicated",
    )
    return client.compute.begin_create_or_update(cluster).result()


def resolve_environment(client, job: AmlJob, staged: StagedJob):
    """The job's environment: ``--environment``'s reference (refused when absent), an image of the same
    content, or a new entity."""
    from azure.core.exceptions import ResourceNotFoundError

    if job.environment is not None:
        name, version = environment_parts(job.environment)
        try:
            found = client.environments.get(
                name, **({"version": version} if version else {"label": "latest"})
            )
        except ResourceNotFoundError:
            raise AmlUsageError(
                f"--environment {job.environment}: the workspace has no such environment. List them with "
                "`az ml environment list`, or drop --environment to let adasum-aml build one"
            ) from None
        say(f"using the registered environment {found.name}:{found.version}")
        return f"azureml:{found.name}:{found.version}"
    name = f"{job.environment_name}:{staged.environment_version}"
    try:
        client.environments.get(job.environment_name, version=staged.environment_version)
    except ResourceNotFoundError:
        say(f"new environment {name}: Azure ML builds it with this job")
        return build_environment(job, staged)
    say(f"reusing the environment {name} (same content as an earlier submit: no image build)")
    return f"azureml:{name}"


def submit(job: AmlJob, staged: StagedJob, config: WorkspaceConfig, *, client=None, stream: bool = False):
    """Submit ``job`` with ``client.jobs.create_or_update``, after its cluster and environment.

    Args:
        client: an ``azure.ai.ml.MLClient`` (default: :func:`connect` to ``config``).
        stream: follow the job's logs until it ends (``client.jobs.stream``).

    Returns:
        ``(the created job entity, its final status or None without stream)``.

    Raises:
        AmlSubmitError: no network; authentication or Azure errors (redacted; names ``az login``).
    """
    from azure.core.exceptions import ClientAuthenticationError

    client = client if client is not None else connect(config)
    try:
        get_or_create_cluster(client, job)
        entity = build(job, staged, resolve_environment(client, job, staged))
        created = client.jobs.create_or_update(entity, experiment_name=job.experiment_name)
        say(f"submitted job {created.name}: {created.studio_url}")
        if not stream:
            return created, None
        try:
            client.jobs.stream(created.name)
        except Exception as err:  # JobException when the job failed: its status below says so
            say(first_line(err))
        status = client.jobs.get(created.name).status
    except AmlUsageError:
        raise
    except ClientAuthenticationError as err:
        raise AmlSubmitError(
            f"Azure authentication failed: {first_line(err)}. Log in with `az login`, or set "
            "AZURE_TENANT_ID, AZURE_CLIENT_ID and AZURE_CLIENT_SECRET"
        ) from err
    except Exception as err:
        raise AmlSubmitError(f"SDK v2 submission failed: {redact(str(err))}") from err
    say(f"job {created.name} ended: {status}")
    return created, status
