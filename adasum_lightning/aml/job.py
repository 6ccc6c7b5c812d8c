"""The SDK-independent description of the Azure ML training job, validated when it is created.

:class:`AmlJob` holds everything both backends (:mod:`.sdk_v1`, :mod:`.sdk_v2`) and the local smoke test
(:mod:`.local`) need: experiment and compute-cluster names, VM size, topology (nodes × MPI processes per
node, one process per GPU), cluster scaling bounds, the training command, environment variables and the
base image of the job environment. Nothing here imports an Azure SDK.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from adasum_lightning import launch_settings


class AmlUsageError(ValueError):
    """Bad input (arguments, config file, topology, VM size): the message names the fix. CLI exit code 2."""


class AmlSubmitError(RuntimeError):
    """Submission failed at run time (no network, authentication, Azure error). CLI exit code 1."""


@dataclass(frozen=True)
class VmSize:
    """An Azure GPU VM size.

    Attributes:
        name: canonical Azure name, e.g. ``"Standard_NC64as_T4_v3"``.
        gpus: GPUs per VM.
        gpu: GPU model and memory, e.g. ``"T4 16 GB"``.
        retired: ``None`` while the size can be deployed, else why and when Azure retired it.
    """

    name: str
    gpus: int
    gpu: str
    retired: str | None = None


def _sizes(gpus_by_name: Mapping[str, int], gpu: str, retired: str | None = None) -> dict[str, VmSize]:
    return {name: VmSize(name, gpus, gpu, retired) for name, gpus in gpus_by_name.items()}


_K80 = "retired by Azure on 2023-08-31 (NC series, NVIDIA K80)"
_P100 = "retired by Azure on 2023-08-31 (NCv2 series, NVIDIA P100)"
_P40 = "retired by Azure on 2023-08-31 (ND series, NVIDIA P40)"
_V100 = "retired by Azure on 2025-09-30 (NCv3 series, NVIDIA V100; also below CUDA 13's minimum sm_75)"

#: Azure GPU VM sizes this launcher knows, current and retired (retired ones are refused with the reason).
VM_SIZES: Mapping[str, VmSize] = MappingProxyType(
    {
        **_sizes(
            {
                "Standard_NC4as_T4_v3": 1,
                "Standard_NC8as_T4_v3": 1,
                "Standard_NC16as_T4_v3": 1,
                "Standard_NC64as_T4_v3": 4,
            },
            "NVIDIA T4 16 GB",
        ),
        **_sizes(
            {"Standard_NC24ads_A100_v4": 1, "Standard_NC48ads_A100_v4": 2, "Standard_NC96ads_A100_v4": 4},
            "NVIDIA A100 80 GB",
        ),
        **_sizes(
            {"Standard_NC40ads_H100_v5": 1, "Standard_NC80adis_H100_v5": 2},
            "NVIDIA H100 NVL 94 GB",
        ),
        "Standard_ND96asr_v4": VmSize("Standard_ND96asr_v4", 8, "NVIDIA A100 40 GB, InfiniBand"),
        "Standard_ND96amsr_A100_v4": VmSize("Standard_ND96amsr_A100_v4", 8, "NVIDIA A100 80 GB, InfiniBand"),
        "Standard_ND96isr_H100_v5": VmSize("Standard_ND96isr_H100_v5", 8, "NVIDIA H100 80 GB, InfiniBand"),
        **_sizes(
            {"Standard_NC6": 1, "Standard_NC12": 2, "Standard_NC24": 4, "Standard_NC24r": 4},
            "NVIDIA K80",
            _K80,
        ),
        **_sizes(
            {"Standard_NC6s_v2": 1, "Standard_NC12s_v2": 2, "Standard_NC24s_v2": 4, "Standard_NC24rs_v2": 4},
            "NVIDIA P100",
            _P100,
        ),
        **_sizes(
            {"Standard_ND6s": 1, "Standard_ND12s": 2, "Standard_ND24s": 4, "Standard_ND24rs": 4},
            "NVIDIA P40",
            _P40,
        ),
        **_sizes(
            {"Standard_NC6s_v3": 1, "Standard_NC12s_v3": 2, "Standard_NC24s_v3": 4, "Standard_NC24rs_v3": 4},
            "NVIDIA V100",
            _V100,
        ),
    }
)

#: Default VM size: 4 × T4 per VM keeps the seed's 8 nodes × 4 GPUs (its Standard_NC24, 4 × K80, is
#: retired); the cheapest current 4-GPU size, and T4 (sm_75) is supported by CUDA 13 builds of PyTorch.
DEFAULT_VM_SIZE = "Standard_NC64as_T4_v3"
DEFAULT_NODE_COUNT = 8
DEFAULT_PROCESSES_PER_NODE = 4
DEFAULT_CLUSTER = "adasum-nc64t4"
DEFAULT_EXPERIMENT = "adasum-lightning-mnist"
#: CUDA 13.0 *devel* image: nvcc and the NCCL headers Horovod's NCCL build needs, the CUDA release that
#: PyTorch 2.14.1's registry wheels are built with. OpenMPI and Python come from Ubuntu 22.04.
DEFAULT_BASE_IMAGE = "nvidia/cuda:13.0.0-devel-ubuntu22.04"
ENVIRONMENT_NAME = "adasum-lightning-horovod-nccl"
#: Seconds an idle node waits before the cluster scales down (cost: min nodes 0 means no idle charge).
IDLE_SECONDS_BEFORE_SCALEDOWN = 1800

#: The training script inside the job's code snapshot (examples/mnist.py, next to adasum_lightning/).
TRAINING_SCRIPT = "mnist.py"
#: Arguments of the MNIST example on the cluster: one GPU per MPI process, Adasum, MNIST downloaded into
#: ./data on each node, Lightning outputs in ./outputs (Azure ML uploads that folder with the run).
DEFAULT_TRAINING_ARGS: tuple[str, ...] = (
    "fit",
    "--trainer.strategy=horovod_adasum",
    "--trainer.accelerator=gpu",
    "--trainer.devices=1",
    "--trainer.max_epochs=10",
    "--trainer.enable_progress_bar=false",
    "--data.data_dir=data",
    "--trainer.default_root_dir=outputs",
)
#: Environment variables every job gets (one intra-op thread per process, NCCL warnings, unbuffered logs).
DEFAULT_ENVIRONMENT_VARIABLES: Mapping[str, str] = MappingProxyType(
    {"OMP_NUM_THREADS": "1", "NCCL_DEBUG": "WARN", "PYTHONUNBUFFERED": "1"}
)

_CLUSTER_RE = re.compile(r"^[A-Za-z][A-Za-z0-9-]{1,14}[A-Za-z0-9]$")
_EXPERIMENT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,254}$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SECRET_RE = re.compile(r"SECRET|PASSWORD|PASSWD|TOKEN|CREDENTIAL|(^|_)KEY($|_)|CONNECTION_STRING|SAS", re.I)


def is_power_of_two(n: int) -> bool:
    """True for 1, 2, 4, 8, …; False for 0, negatives and non-integers (``bool`` included)."""
    return isinstance(n, int) and not isinstance(n, bool) and n > 0 and n & (n - 1) == 0


def lookup_vm_size(name: str) -> VmSize:
    """The :class:`VmSize` called ``name`` (case-insensitive).

    Raises:
        AmlUsageError: unknown size (lists the current 4- and 8-GPU sizes), or a retired one (says when and
            why, and what to use instead).
    """
    by_lower = {k.lower(): v for k, v in VM_SIZES.items()}
    size = by_lower.get(str(name).strip().lower())
    current = sorted(v.name for v in VM_SIZES.values() if v.retired is None and v.gpus >= 4)
    if size is None:
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


def _size_with_gpus(gpus: int) -> str:
    """The first current VM size (table order: cheapest family first) with at least ``gpus`` GPUs."""
    return next((s.name for s in VM_SIZES.values() if s.retired is None and s.gpus >= gpus), "?")


@dataclass(frozen=True)
class AmlJob:
    """One Azure ML training job of the MNIST example with Horovod Adasum.

    The job runs ``node_count × process_count_per_node`` MPI processes, one per GPU. Azure ML starts the
    training command once per process under its own ``mpirun``.

    Attributes:
        experiment_name: Azure ML experiment the run is filed under (letters, digits, ``_``, ``-``).
        compute_name: AmlCompute cluster name (2–16 characters: letters, digits, ``-``; starts with a
            letter). Created on first submit if the workspace lacks it.
        vm_size: Azure VM size of each node; must be current and have ≥ ``process_count_per_node`` GPUs.
        node_count: nodes the job runs on (power of 2: Adasum combines 2^k nodes). Default 8.
        process_count_per_node: MPI processes (= GPUs used) per node (power of 2). Default 4.
        min_nodes: cluster minimum size; 0 (default) means no node is billed while the cluster is idle.
        max_nodes: cluster maximum size (≥ ``node_count``); ``None`` means ``node_count``.
        training_args: extra arguments appended to the example's command line (LightningCLI: the last
            value of an option wins), e.g. ``("--trainer.max_epochs=2",)``.
        environment_variables: extra environment variables of the job (merged over
            :data:`DEFAULT_ENVIRONMENT_VARIABLES` and Open MPI's fault settings
            :func:`adasum_lightning.launch_settings.mpi_env`, which Azure ML's ``mpirun`` reads). Names that
            look like secrets are refused: job variables are visible in the run's details.
        base_image: base image of the job environment's Dockerfile (needs nvcc and NCCL headers).

    Raises:
        AmlUsageError: on creation, for any invalid field (the message names the fix).
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
    base_image: str = DEFAULT_BASE_IMAGE

    def __post_init__(self) -> None:
        for name, flag in (("node_count", "--nodes"), ("process_count_per_node", "--gpus-per-node")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise AmlUsageError(f"{name} must be a positive integer, got {value!r}: fix {flag}")
            if not is_power_of_two(value):
                lower, upper = 1 << (value.bit_length() - 1), 1 << value.bit_length()
                raise AmlUsageError(
                    f"{name}={value} is not a power of 2; Adasum combines 2^k workers. "
                    f"Use {flag} {lower} or {flag} {upper}"
                )
        size = lookup_vm_size(self.vm_size)
        object.__setattr__(self, "vm_size", size.name)
        if self.process_count_per_node > size.gpus:
            raise AmlUsageError(
                f"{size.name} has {size.gpus} GPU(s) ({size.gpu}) but process_count_per_node is "
                f"{self.process_count_per_node} (one process per GPU). Use --gpus-per-node {size.gpus} or a "
                f"VM size with {self.process_count_per_node} GPUs or more "
                f"(--vm-size {_size_with_gpus(self.process_count_per_node)})"
            )
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
        object.__setattr__(self, "max_nodes", max_nodes)
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
        if not isinstance(self.base_image, str) or not self.base_image.strip() or " " in self.base_image:
            raise AmlUsageError(f"base image {self.base_image!r} is not an image reference: fix --base-image")
        args = tuple(self.training_args)
        if not all(isinstance(a, str) for a in args):
            raise AmlUsageError(f"training arguments must be strings, got {args!r}")
        object.__setattr__(self, "training_args", args)
        env = dict(DEFAULT_ENVIRONMENT_VARIABLES)
        env.update(launch_settings.mpi_env())
        for key, value in dict(self.environment_variables).items():
            if not isinstance(key, str) or not _ENV_NAME_RE.match(key):
                raise AmlUsageError(f"environment variable name {key!r} is invalid: fix --env NAME=VALUE")
            if _SECRET_RE.search(key):
                raise AmlUsageError(
                    f"environment variable {key} looks like a secret; job variables are shown in the run's "
                    "details and in --dry-run output. Keep secrets in the workspace's key vault instead"
                )
            env[key] = str(value)
        object.__setattr__(self, "environment_variables", MappingProxyType(env))

    @property
    def world_size(self) -> int:
        """Total MPI processes (GPUs) of the job: ``node_count × process_count_per_node``."""
        return self.node_count * self.process_count_per_node

    def training_command(self, python: str = "python") -> list[str]:
        """The command every MPI process runs, as an argument list, e.g.
        ``["python", "mnist.py", "fit", "--trainer.strategy=horovod_adasum", ...]``.

        Args:
            python: interpreter to start (``"python"`` on the cluster: the image's venv is first on PATH).
        """
        return [python, TRAINING_SCRIPT, *DEFAULT_TRAINING_ARGS, *self.training_args]

    def command_line(self) -> str:
        """:meth:`training_command` as one shell-quoted string (the SDK v2 ``command``)."""
        return shlex.join(self.training_command())
