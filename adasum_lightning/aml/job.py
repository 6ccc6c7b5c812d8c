"""The SDK-independent description of an Azure ML training job (:class:`AmlJob`), validated on creation.

The Horovod strategies run as an Azure ML MPI job, ``ddp_adasum`` as a PyTorch job. Imports no Azure SDK.
"""

from __future__ import annotations

import datetime
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from adasum_lightning import failure_detection
from adasum_lightning.aml.errors import AmlUsageError
from adasum_lightning.aml.project import DataBinding, check_placeholders
from adasum_lightning.reference import is_power_of_two, nearest_powers_of_two


@dataclass(frozen=True)
class VmSize:
    """An Azure GPU VM size: name, GPUs per VM, GPU model, and why and when Azure retired it (or ``None``)."""

    name: str
    gpus: int
    gpu: str
    retired: str | None = None


_RETIRED = "retired by Azure on {} ({} series, NVIDIA {})"
#: Per GPU series: the GPU, why Azure retired the series (None: current), ``Standard_`` sizes and their GPUs.
_SERIES: tuple[tuple[str, str | None, str], ...] = (
    ("NVIDIA T4 16 GB", None, "NC4as_T4_v3:1 NC8as_T4_v3:1 NC16as_T4_v3:1 NC64as_T4_v3:4"),
    ("NVIDIA A100 80 GB", None, "NC24ads_A100_v4:1 NC48ads_A100_v4:2 NC96ads_A100_v4:4"),
    ("NVIDIA H100 NVL 94 GB", None, "NC40ads_H100_v5:1 NC80adis_H100_v5:2"),
    ("NVIDIA A100 40 GB, InfiniBand", None, "ND96asr_v4:8"),
    ("NVIDIA A100 80 GB, InfiniBand", None, "ND96amsr_A100_v4:8"),
    ("NVIDIA H100 80 GB, InfiniBand", None, "ND96isr_H100_v5:8"),
    ("NVIDIA K80", _RETIRED.format("2023-08-31", "NC", "K80"), "NC6:1 NC12:2 NC24:4 NC24r:4"),
    (
        "NVIDIA P100",
        _RETIRED.format("2023-08-31", "NCv2", "P100"),
        "NC6s_v2:1 NC12s_v2:2 NC24s_v2:4 NC24rs_v2:4",
    ),
    ("NVIDIA P40", _RETIRED.format("2023-08-31", "ND", "P40"), "ND6s:1 ND12s:2 ND24s:4 ND24rs:4"),
    (
        "NVIDIA V100",
        _RETIRED.format("2025-09-30", "NCv3", "V100; also below CUDA 13's minimum sm_75"),
        "NC6s_v3:1 NC12s_v3:2 NC24s_v3:4 NC24rs_v3:4",
    ),
)
#: Azure GPU VM sizes this launcher knows, current and retired (retired ones are refused with the reason).
VM_SIZES: Mapping[str, VmSize] = MappingProxyType(
    {
        f"Standard_{name}": VmSize(f"Standard_{name}", int(gpus), gpu, retired)
        for gpu, retired, sizes in _SERIES
        for name, gpus in (size.split(":") for size in sizes.split())
    }
)

#: Default VM size: the cheapest current 4-GPU size (4 × T4, sm_75, which CUDA 13 builds of PyTorch support).
DEFAULT_VM_SIZE = "Standard_NC64as_T4_v3"
DEFAULT_NODE_COUNT = 8
DEFAULT_PROCESSES_PER_NODE = 4
DEFAULT_CLUSTER = "adasum-nc64t4"
DEFAULT_EXPERIMENT = "adasum-lightning-mnist"
#: A runtime image of torch's CUDA release: Horovod is compiled with the registry's cuda-toolkit wheels.
DEFAULT_BASE_IMAGE = "nvidia/cuda:13.0.0-runtime-ubuntu22.04"
DEFAULT_DDP_BASE_IMAGE = "nvidia/cuda:13.0.0-runtime-ubuntu22.04"
ENVIRONMENT_NAME = "adasum-lightning-horovod-nccl"
DDP_ENVIRONMENT_NAME = "adasum-lightning-ddp"
STRATEGIES: tuple[str, ...] = ("horovod_adasum", "horovod", "ddp_adasum")
MPI_STRATEGIES = frozenset({"horovod_adasum", "horovod"})
DEFAULT_STRATEGY = "horovod_adasum"

#: The variables Azure ML sets in every process of a PyTorch job (so ``--env`` must not set them). Lightning
#: takes the world size from devices × num_nodes, not WORLD_SIZE: the job sets both (docs/azure_ml.md).
AML_PYTORCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK", "RANK", "LOCAL_RANK")
#: ``ddp_adasum`` as its class path, so that LightningCLI takes ``--trainer.strategy.timeout``
#: (a strategy *name* takes no arguments); it resolves to the class of the Lightning package imported.
DDP_STRATEGY_CLASS = "adasum_lightning.DDPAdasumStrategy"
SHM_SIZE = "16g"  # of each job container: DataLoader workers pass batches through /dev/shm
IDLE_SECONDS_BEFORE_SCALEDOWN = 1800

#: The job's output that holds Lightning's checkpoints with ``resume`` (``${{outputs.checkpoints}}``).
CHECKPOINT_OUTPUT = "checkpoints"
#: Where that output goes without ``--output checkpoints=URI``: a folder per submission, the same for every
#: restart of the job (a preempted job restarts with the definition it was submitted with).
CHECKPOINT_DATASTORE_PATH = (
    "azureml://datastores/workspaceblobstore/paths/adasum-checkpoints/{experiment}/{stamp}"
)
#: The LightningCLI arguments of ``resume``: a ``ModelCheckpoint`` that keeps ``last.ckpt`` in the output,
#: and ``fit(ckpt_path="last")`` (Lightning starts fresh when there is none yet).
RESUME_ARGS = (
    "--trainer.callbacks+=ModelCheckpoint",
    f"--trainer.callbacks.dirpath=${{{{outputs.{CHECKPOINT_OUTPUT}}}}}",
)
RESUME_ARGS += ("--trainer.callbacks.save_last=true", "--ckpt_path=last")

TRAINING_SCRIPT = "mnist.py"
#: The bundled example's cluster arguments: MNIST into ./data, outputs in ./outputs (uploaded by Azure ML).
_COMMON_TRAINING_ARGS = (
    "--trainer.max_epochs=10",
    "--trainer.enable_progress_bar=false",
    "--data.data_dir=data",
)
_COMMON_TRAINING_ARGS += ("--trainer.default_root_dir=outputs",)
#: The training arguments of the default job; see :meth:`AmlJob.training_command`.
DEFAULT_TRAINING_ARGS = ("fit", "--trainer.strategy=horovod_adasum", "--trainer.accelerator=gpu")
DEFAULT_TRAINING_ARGS += ("--trainer.devices=1", *_COMMON_TRAINING_ARGS)
#: Environment variables every job gets (one intra-op thread per process, NCCL warnings, unbuffered logs).
DEFAULT_ENVIRONMENT_VARIABLES: Mapping[str, str] = MappingProxyType(
    {"OMP_NUM_THREADS": "1", "NCCL_DEBUG": "WARN", "PYTHONUNBUFFERED": "1"}
)

_CLUSTER_RE = re.compile(r"^[A-Za-z][A-Za-z0-9-]{1,14}[A-Za-z0-9]$")
_EXPERIMENT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,254}$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SECRET_RE = re.compile(r"SECRET|PASSWORD|PASSWD|TOKEN|CREDENTIAL|(^|_)KEY($|_)|CONNECTION_STRING|SAS", re.I)
_ENVIRONMENT_RE = re.compile(
    r"^(azureml:)?(?P<name>[A-Za-z0-9][A-Za-z0-9_.-]{0,254})((:(?P<version>[A-Za-z0-9][A-Za-z0-9_.-]*))|@latest)?$"
)
#: What every process learns of the job's strategy and topology (:meth:`AmlJob.topology_variables`).
TOPOLOGY_VARIABLES = ("ADASUM_STRATEGY", "ADASUM_ACCELERATOR", "ADASUM_DEVICES", "ADASUM_NUM_NODES")


def experiment_name_for(project: str | None) -> str:
    """The experiment of a job without ``--experiment``: the project's folder name (each character Azure ML
    refuses as ``-``), or :data:`DEFAULT_EXPERIMENT` for the bundled example."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", project or "").lstrip("_-")[:255] or DEFAULT_EXPERIMENT


def environment_parts(reference: str) -> tuple[str, str | None]:
    """``(name, version)`` of a normalized reference (version ``None`` for ``@latest``)."""
    body = reference.removeprefix("azureml:")
    if body.endswith("@latest"):
        return body.removesuffix("@latest"), None
    name, _, version = body.rpartition(":")
    return name, version


def option_values(args: Sequence[str], name: str) -> list[str]:
    """Values given to the option ``name`` in ``args`` (``--name=value`` or ``--name value``), in order."""
    given = [(i, arg) for i, arg in enumerate(args) if arg.startswith(name + "=") or arg == name]
    return [
        arg.partition("=")[2] if arg != name else args[i + 1]
        for i, arg in given
        if arg != name or i + 1 < len(args)
    ]


def lookup_vm_size(name: str) -> VmSize:
    """The :class:`VmSize` called ``name`` (case-insensitive); an unknown or retired one is refused."""
    size = {k.lower(): v for k, v in VM_SIZES.items()}.get(str(name).strip().lower())
    if size is None:
        current = sorted(v.name for v in VM_SIZES.values() if v.retired is None and v.gpus >= 4)
        raise AmlUsageError(
            f"unknown VM size {name!r}. Pass --vm-size with a current GPU size, e.g. {DEFAULT_VM_SIZE} "
            f"(4 × T4) or Standard_NC96ads_A100_v4 (4 × A100); multi-GPU sizes known: {', '.join(current)}"
        )
    if size.retired:
        raise AmlUsageError(
            f"VM size {size.name} was {size.retired}. Pass --vm-size {DEFAULT_VM_SIZE} (4 × T4, the default) "
            "or Standard_NC96ads_A100_v4 (4 × A100) to keep 4 GPUs per node"
        )
    return size


def check_process_count(value: object, name: str, flag: str, strategy: str) -> None:
    """Refuse a node or process count that is not a positive integer, or for ``horovod_adasum`` (Horovod's
    Adasum combines 2^k workers) not a power of 2; the message names ``flag`` and the nearest valid counts."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AmlUsageError(f"{name} must be a positive integer, got {value!r}: fix {flag}")
    if strategy == "horovod_adasum" and not is_power_of_two(value):
        counts = " or ".join(f"{flag} {n}" for n in nearest_powers_of_two(value))
        raise AmlUsageError(
            f"{name}={value} is not a power of 2; Horovod's Adasum combines 2^k workers. "
            f"Use {counts}, or --strategy ddp_adasum (any count)"
        )


@dataclass(frozen=True)
class AmlJob:
    """One Azure ML job (a process per GPU) training a Lightning script with an Adasum or Horovod strategy.

    Attributes:
        experiment_name, compute_name: the Azure ML experiment and AmlCompute cluster (created if missing).
        vm_size: each node's VM size; current, with ≥ ``process_count_per_node`` GPUs.
        node_count, process_count_per_node: nodes and processes (= GPUs) per node; powers of 2 for
            ``horovod_adasum``.
        min_nodes, max_nodes: the cluster's scaling bounds (0, and ``None`` for ``node_count``).
        training_args: arguments of the script (for the bundled example: appended to its defaults).
        environment_variables: extra job variables, merged over :data:`DEFAULT_ENVIRONMENT_VARIABLES` (and
            Open MPI's fault settings for MPI jobs); names that look like secrets are refused.
        base_image: the job image's base (``None``: the CUDA 13.0 runtime image).
        script: the entry script in the source directory (``None``: the bundled MNIST example).
        trainer_args: a LightningCLI script: :meth:`strategy_args` are appended to its arguments.
        data: the ``--input``/``--output`` bindings (:class:`.project.DataBinding`).
        environment: a registered Azure ML environment (``azureml:NAME:VERSION``) to run in, not an image.
        low_priority: a new cluster gets low-priority (spot) VMs, which Azure may preempt; implies ``resume``.
        resume: Lightning's checkpoints go to the output ``checkpoints`` (:data:`CHECKPOINT_DATASTORE_PATH`
            unless given), and a restarted job resumes from the last one (:data:`RESUME_ARGS`).

    Raises:
        AmlUsageError: on creation, for any invalid field or combination (the message names the fix).
    """

    experiment_name: str = DEFAULT_EXPERIMENT
    compute_name: str = DEFAULT_CLUSTER
    vm_size: str = DEFAULT_VM_SIZE
    node_count: int = DEFAULT_NODE_COUNT
    process_count_per_node: int = DEFAULT_PROCESSES_PER_NODE
    min_nodes: int = 0
    max_nodes: int | None = None
    training_args: Sequence[str] = ()
    environment_variables: Mapping[str, str] = field(default_factory=dict)
    base_image: str | None = None
    strategy: str = DEFAULT_STRATEGY
    script: str | None = None
    trainer_args: bool = True
    data: tuple[DataBinding, ...] = ()
    requirements: tuple[str, ...] = ()
    environment: str | None = None
    low_priority: bool = False
    resume: bool = False

    @property
    def is_mpi(self) -> bool:
        """True for the Horovod strategies (an Azure ML MPI job), False for ``ddp_adasum`` (a PyTorch job)."""
        return self.strategy in MPI_STRATEGIES

    @property
    def devices(self) -> int:
        """``--trainer.devices`` of the job's command: 1 per MPI process, the GPUs per node for DDP."""
        return 1 if self.is_mpi else self.process_count_per_node

    @property
    def environment_name(self) -> str:
        """Name of the Azure ML environment (the job image) for this strategy."""
        return ENVIRONMENT_NAME if self.is_mpi else DDP_ENVIRONMENT_NAME

    @property
    def world_size(self) -> int:
        return self.node_count * self.process_count_per_node

    @property
    def cluster_nodes(self) -> str:
        """The cluster's scaling bounds in words, e.g. ``0–8 low-priority nodes``."""
        return f"{self.min_nodes}–{self.max_nodes} {'low-priority ' if self.low_priority else ''}nodes"

    @property
    def script_name(self) -> str:
        """The entry script inside the code snapshot: ``SCRIPT`` or the bundled example's ``mnist.py``."""
        return TRAINING_SCRIPT if self.script is None else self.script

    def __post_init__(self) -> None:
        self._check_topology()
        self._check_cluster()
        self._resolve_image()
        self._check_arguments()
        self._resolve_environment_variables()

    def _set(self, **fields) -> None:
        for name, value in fields.items():
            object.__setattr__(self, name, value)  # the dataclass is frozen; these are its normalized fields

    def _check_topology(self) -> None:
        """The strategy, the node and process counts and the VM size that has the GPUs for them."""
        if self.strategy not in STRATEGIES:
            raise AmlUsageError(
                f"unknown strategy {self.strategy!r}: use --strategy horovod_adasum (Horovod's Adasum, an "
                "MPI job), --strategy horovod (Horovod averaging, an MPI job) or --strategy ddp_adasum "
                "(Adasum on torch.distributed, a PyTorch job)"
            )
        check_process_count(self.node_count, "node_count", "--nodes", self.strategy)
        check_process_count(
            self.process_count_per_node, "process_count_per_node", "--gpus-per-node", self.strategy
        )
        size, gpus = lookup_vm_size(self.vm_size), self.process_count_per_node
        self._set(vm_size=size.name)
        if gpus > size.gpus:
            bigger = next((s.name for s in VM_SIZES.values() if s.retired is None and s.gpus >= gpus), "?")
            raise AmlUsageError(
                f"{size.name} has {size.gpus} GPU(s) ({size.gpu}) but process_count_per_node is {gpus} (one "
                f"process per GPU). Use --gpus-per-node {size.gpus} or a VM size with {gpus} GPUs or more "
                f"(--vm-size {bigger})"
            )

    def _check_cluster(self) -> None:
        """The cluster's scaling bounds (``max_nodes`` resolved), its name and the experiment's name."""
        max_nodes = self.node_count if self.max_nodes is None else self.max_nodes
        if isinstance(self.min_nodes, bool) or not isinstance(self.min_nodes, int) or self.min_nodes < 0:
            raise AmlUsageError(f"min_nodes must be an integer ≥ 0, got {self.min_nodes!r}: fix --min-nodes")
        if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < self.node_count:
            raise AmlUsageError(
                f"max_nodes must be an integer ≥ node_count ({self.node_count}), got {max_nodes!r}: "
                "fix --max-nodes"
            )
        if self.min_nodes > max_nodes:
            raise AmlUsageError(f"min_nodes {self.min_nodes} exceeds max_nodes {max_nodes}: fix --min-nodes")
        self._set(max_nodes=max_nodes)
        if not isinstance(self.compute_name, str) or not _CLUSTER_RE.match(self.compute_name):
            raise AmlUsageError(
                f"cluster name {self.compute_name!r} is invalid: Azure ML compute names have 2–16 characters "
                "(letters, digits, '-'), start with a letter and do not end with '-'. Fix --cluster"
            )
        if not isinstance(self.experiment_name, str) or not _EXPERIMENT_RE.match(self.experiment_name):
            raise AmlUsageError(
                f"experiment name {self.experiment_name!r} is invalid: use 1–255 letters, digits, '_' or '-' "
                "starting with a letter or digit. Fix --experiment"
            )

    def _resolve_image(self) -> None:
        """The base image (default by job kind), or a registered environment without ``requirements``."""
        if self.environment is not None and self.base_image is not None:
            raise AmlUsageError(
                f"--base-image {self.base_image} is the base of the image this launcher builds, but "
                f"--environment {self.environment} uses a registered one: drop one of them"
            )
        base_image = self.base_image or (DEFAULT_BASE_IMAGE if self.is_mpi else DEFAULT_DDP_BASE_IMAGE)
        if not isinstance(base_image, str) or not base_image.strip() or " " in base_image:
            raise AmlUsageError(f"base image {base_image!r} is not an image reference: fix --base-image")
        self._set(base_image=base_image)
        if self.environment is not None and self.requirements:
            raise AmlUsageError(
                "--requirements adds packages to the image this launcher builds, but --environment "
                f"{self.environment} uses a registered one: add the packages to that environment, or drop "
                "--environment"
            )
        if self.environment is None:
            return
        match = _ENVIRONMENT_RE.match(
            str(self.environment).strip()
        )  # written azureml:NAME:VERSION or @latest
        if not match:
            raise AmlUsageError(
                f"--environment {self.environment!r} is not an Azure ML environment reference: pass "
                "NAME:VERSION, azureml:NAME:VERSION or NAME@latest (az ml environment list shows yours)"
            )
        version = f":{match['version']}" if match["version"] else "@latest"
        self._set(environment=f"azureml:{match['name']}{version}")

    def _check_arguments(self) -> None:
        """The script's arguments against the strategy and topology, and the data they name."""
        args = tuple(self.training_args)
        if not all(isinstance(a, str) for a in args):
            raise AmlUsageError(f"training arguments must be strings, got {args!r}")
        if self.script is None and not self.trainer_args:
            raise AmlUsageError("the bundled MNIST example is a LightningCLI script: drop --trainer-args off")
        if self.trainer_args:
            self._check_training_args(args)
        self._set(data=tuple(self.data), requirements=tuple(self.requirements), training_args=args)
        if self.low_priority or self.resume:
            self._add_checkpoint_output(args)
        check_placeholders(args, self.data)

    def _add_checkpoint_output(self, args: tuple[str, ...]) -> None:
        """``resume``: the output ``checkpoints`` (a new folder unless given), which the script must use."""
        self._set(resume=True)
        placeholder = f"${{{{outputs.{CHECKPOINT_OUTPUT}}}}}"
        if not self.trainer_args and not any(placeholder in a for a in args):
            raise AmlUsageError(
                "--resume (and --low-priority) keep the checkpoints in the job's output "
                f"{CHECKPOINT_OUTPUT}, but {self.script} is not a LightningCLI script, so adasum-aml cannot "
                f"point its Trainer there: pass the folder to it (-- --checkpoint-dir '{placeholder}') and "
                "resume from its last checkpoint, or pass --trainer-args on if it is a LightningCLI script"
            )
        if not any(b.name == CHECKPOINT_OUTPUT for b in self.data if b.direction == "outputs"):
            stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S-%f")
            uri = CHECKPOINT_DATASTORE_PATH.format(experiment=self.experiment_name, stamp=stamp)
            self._set(data=(*self.data, DataBinding(CHECKPOINT_OUTPUT, uri, "outputs", mode="rw_mount")))

    def _resolve_environment_variables(self) -> None:
        """The job's variables: the defaults, the topology's, Open MPI's fault settings for MPI jobs, then
        the user's (refused when they look like secrets or set what adasum-aml or Azure ML sets)."""
        env = {**DEFAULT_ENVIRONMENT_VARIABLES, **self.topology_variables()}
        env.update(failure_detection.mpi_env() if self.is_mpi else {})
        for key, value in dict(self.environment_variables).items():
            if not isinstance(key, str) or not _ENV_NAME_RE.match(key):
                raise AmlUsageError(f"environment variable name {key!r} is invalid: fix --env NAME=VALUE")
            if _SECRET_RE.search(key):
                raise AmlUsageError(
                    f"environment variable {key} looks like a secret; job variables are shown in the run's "
                    "details and in --dry-run output. Keep secrets in the workspace's key vault instead"
                )
            if key in TOPOLOGY_VARIABLES:
                raise AmlUsageError(
                    f"environment variable {key} is set by adasum-aml from --strategy, --nodes and "
                    f"--gpus-per-node: remove --env {key}=…"
                )
            if not self.is_mpi and key in AML_PYTORCH_VARIABLES:
                raise AmlUsageError(
                    f"environment variable {key} is set by Azure ML in every process of a PyTorch job "
                    f"(--strategy ddp_adasum); remove --env {key}=…"
                )
            if not self.is_mpi and key.startswith(("OMPI_", "HOROVOD_")):
                raise AmlUsageError(
                    f"environment variable {key} has no effect in a --strategy ddp_adasum job (no MPI, no "
                    f"Horovod): remove --env {key}=…, or use --strategy horovod_adasum"
                )
            env[key] = str(value)
        self._set(environment_variables=MappingProxyType(env))

    def _check_training_args(self, args: tuple[str, ...]) -> None:
        """Refuse training arguments that would contradict the strategy or the topology of the job."""
        if option_values(args, "--trainer.strategy"):
            raise AmlUsageError(
                "the job's strategy is chosen with --strategy (it also decides the kind of Azure ML job: MPI "
                "or PyTorch), not with --trainer.strategy: remove --trainer.strategy and pass --strategy "
                f"{' or --strategy '.join(STRATEGIES)}"
            )
        fixed = {"--trainer.devices": ("--gpus-per-node", self.devices)}
        if not self.is_mpi:
            fixed["--trainer.num_nodes"] = ("--nodes", self.node_count)
        for option, (flag, expected) in fixed.items():
            for value in (v for v in option_values(args, option) if v.strip() != str(expected)):
                if self.is_mpi:
                    raise AmlUsageError(
                        f"{option}={value}: each MPI process of a --strategy {self.strategy} job drives one "
                        f"GPU ({option}=1). Remove {option}; set the GPUs per node with {flag} N"
                    )
                count = value.strip() if value.strip().isdigit() and int(value) > 0 else "N"
                raise AmlUsageError(
                    f"{option}={value} contradicts the job's topology ({option}={expected}): Lightning "
                    "computes the ranks of an Azure ML PyTorch job from devices × num_nodes, and any other "
                    f"value hangs or duplicates ranks. Remove {option}; set it with {flag} {count}"
                )

    def check_existing_cluster(self, vm_size: str, max_nodes: object, priority: str) -> None:
        """Refuse an existing cluster of another VM size, fewer than ``node_count`` nodes, or dedicated VMs
        for ``low_priority`` (v1 ``lowpriority``, v2 ``low_priority``; empty: unknown)."""
        if vm_size and vm_size.lower() != self.vm_size.lower():
            raise AmlUsageError(
                f"the cluster {self.compute_name} exists with VM size {vm_size}, not {self.vm_size}. Pass "
                f"--vm-size {vm_size}, or --cluster NEW_NAME to create a {self.vm_size} cluster"
            )
        if isinstance(max_nodes, int) and max_nodes < self.node_count:
            raise AmlUsageError(
                f"the cluster {self.compute_name} scales to {max_nodes} nodes, fewer than --nodes "
                f"{self.node_count}. Raise its maximum in Azure ML studio, or pass --nodes {max_nodes} or a "
                "new --cluster name"
            )
        if self.low_priority and priority and priority.lower().replace("_", "") != "lowpriority":
            raise AmlUsageError(
                f"the cluster {self.compute_name} exists with {priority} VMs, so --low-priority would not "
                "apply: pass --cluster NEW_NAME to create a low-priority cluster, or drop --low-priority"
            )

    def strategy_args(self) -> list[str]:
        """The Trainer arguments that follow from the strategy and the topology (for ``ddp_adasum`` its class,
        with the timeout :data:`adasum_lightning.failure_detection.DDP_PROCESS_GROUP_TIMEOUT`)."""
        if self.is_mpi:
            return [f"--trainer.strategy={self.strategy}", "--trainer.accelerator=gpu", "--trainer.devices=1"]
        return [
            f"--trainer.strategy={DDP_STRATEGY_CLASS}",
            f"--trainer.strategy.timeout={failure_detection.DDP_PROCESS_GROUP_TIMEOUT}",  # H:MM:SS
            "--trainer.accelerator=gpu",
            f"--trainer.devices={self.process_count_per_node}",
            f"--trainer.num_nodes={self.node_count}",
        ]

    def topology_variables(
        self, accelerator: str = "gpu", devices: int = 0, nodes: int = 0
    ) -> dict[str, str]:
        """The :data:`TOPOLOGY_VARIABLES` of every process, for scripts without ``--trainer.*`` arguments
        (``ADASUM_DEVICES`` is the Trainer's ``devices``; 0: the job's)."""
        values = (self.strategy, accelerator, str(devices or self.devices), str(nodes or self.node_count))
        return dict(zip(TOPOLOGY_VARIABLES, values, strict=True))

    def training_command(self, python: str = "python") -> list[str]:
        """The command every process runs, its ``${{…}}`` placeholders unbound: the bundled example's ``fit``,
        :meth:`strategy_args` and cluster defaults then the training arguments, or a script's arguments then
        :meth:`strategy_args` (the job's topology wins over a config file); :data:`RESUME_ARGS` last."""
        resume = list(RESUME_ARGS) if self.resume and self.trainer_args else []
        if self.script is None:
            example = [TRAINING_SCRIPT, "fit", *self.strategy_args(), *_COMMON_TRAINING_ARGS]
            return [python, *example, *self.training_args, *resume]
        trainer = self.strategy_args() if self.trainer_args else []
        return [python, self.script, *self.training_args, *trainer, *resume]

    def command_line(self) -> str:
        """:meth:`training_command` as one shell-quoted string (the SDK v2 ``command``)."""
        return shlex.join(self.training_command())
