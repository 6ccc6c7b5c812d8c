"""Rules that refuse configurations in which Horovod's Adasum would fail late or silently.

Each rule is a pure function of plain values, so it can be tested exhaustively without processes; the
strategy calls them while ``Trainer.fit`` sets up, before any training step. Every rank evaluates them on
the same (gathered) values, so every rank raises the same :class:`AdasumConfigurationError` and the job
exits instead of hanging in a collective.

Sources: Horovod 0.28.1 ``horovod/torch/mpi_ops.py`` (CPU Adasum needs a power-of-2 world size),
``horovod/common/ops/adasum_gpu_operations.cc`` and ``docs/adasum_user_guide.rst`` (NCCL Adasum:
reduce-scatter inside a node, Adasum across nodes, power-of-2 node count, homogeneous nodes),
``horovod/common/operations.cc`` (Adasum is registered for MPI only), ``horovod/torch/optimizer.py``
(the local step runs inside the backward hook; ``gradient_predivide_factor`` needs op=Average).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Sequence

import torch
from lightning_fabric.utilities.exceptions import MisconfigurationException

from adasum_lightning.ops import is_power_of_two

__all__ = [
    "AdasumConfigurationError",
    "nearest_powers_of_two",
    "check_world_size",
    "check_nccl_topology",
    "check_controller",
    "check_cpu_operations",
    "check_precision",
    "check_gradient_clipping",
    "check_gradient_predivide_factor",
    "check_single_device",
    "unreadable_checkpoint",
    "CHECKPOINT_READ_ERRORS",
]


class AdasumConfigurationError(MisconfigurationException):
    """A configuration that Horovod's Adasum cannot run correctly; the message names the fix."""


def nearest_powers_of_two(n: int) -> list[int]:
    """The powers of 2 just below and just above ``n`` (one value when ``n`` < 2 or a power of 2)."""
    if n < 1:
        return [1]
    lower = 1 << (n.bit_length() - 1)
    return [lower] if lower == n else [lower, lower * 2]


def _sizes(n: int) -> str:
    return " or ".join(str(v) for v in nearest_powers_of_two(n))


def check_world_size(size: int) -> None:
    """CPU (MPI) Adasum: the world size must be a power of 2.

    Horovod otherwise raises ``NotImplementedError`` in the middle of the first step.

    Raises:
        AdasumConfigurationError: naming the nearest valid sizes.
    """
    if not is_power_of_two(size):
        raise AdasumConfigurationError(
            f"horovod_adasum needs a world size that is a power of 2 (1, 2, 4, 8, …) for Adasum over MPI; "
            f"this job has {size} processes. Launch {_sizes(size)} processes (horovodrun -np N), or use "
            f"strategy='horovod' (gradient averaging), which takes any size."
        )


def check_nccl_topology(size: int, local_sizes: Sequence[int]) -> str | None:
    """NCCL GPU Adasum: power-of-2 node count and GPUs per node, the same on every node.

    Args:
        size: world size (processes in the job).
        local_sizes: every rank's ``hvd.local_size()`` (processes on its node), in rank order.

    Returns:
        A warning text when the job has a single node (Adasum then degenerates to averaging inside the
        node), else None.

    Raises:
        AdasumConfigurationError: heterogeneous nodes, or a node count or local size not a power of 2.
    """
    distinct = sorted(set(local_sizes))
    if len(distinct) != 1:
        raise AdasumConfigurationError(
            f"horovod_adasum with NCCL needs the same number of processes on every node; found {distinct} "
            "processes per node. Launch one process per GPU with the same GPU count on every node "
            "(e.g. horovodrun -H host1:4,host2:4)."
        )
    local = distinct[0]
    if not is_power_of_two(local):
        raise AdasumConfigurationError(
            f"horovod_adasum with NCCL needs a power-of-2 number of processes per node; found {local}. "
            f"Use {_sizes(local)} GPUs per node (Horovod issue #3400: 3 of 4 GPUs fails)."
        )
    nodes = size // local
    if not is_power_of_two(nodes):
        raise AdasumConfigurationError(
            f"horovod_adasum with NCCL needs a power-of-2 number of nodes; found {nodes} nodes of {local} "
            f"processes. Use {_sizes(nodes)} nodes."
        )
    if nodes == 1 and local > 1:
        return (
            f"horovod_adasum with NCCL on a single node: Horovod averages inside a node and applies Adasum "
            f"only across nodes, so this job averages its {local} GPUs' updates; the learning rate is "
            f"multiplied by {local} (GPUs per node), as for averaging."
        )
    return None


def check_controller(*, mpi_built: bool, mpi_enabled: bool, gloo_enabled: bool) -> None:
    """Adasum is implemented for the MPI controller only.

    Args:
        mpi_built, mpi_enabled, gloo_enabled: ``hvd.mpi_built()``, ``hvd.mpi_enabled()``,
            ``hvd.gloo_enabled()``.

    Raises:
        AdasumConfigurationError: Horovod without MPI, or the Gloo controller (``horovodrun --gloo``).
    """
    if not mpi_built:
        raise AdasumConfigurationError(
            "horovod_adasum needs Horovod built with MPI (Adasum exists only for the MPI controller); this "
            "Horovod has no MPI support. Rebuild it with `make setup` (HOROVOD_WITH_MPI=1), or use "
            "strategy='horovod' (averaging works with Gloo)."
        )
    if gloo_enabled or not mpi_enabled:
        raise AdasumConfigurationError(
            "horovod_adasum needs the MPI controller, but this job runs under Gloo (horovodrun --gloo), "
            "where Horovod has no Adasum operation. Launch with `horovodrun --mpi -np N ...` or "
            "`mpirun -np N ...`, or use strategy='horovod' (averaging works with Gloo)."
        )


def check_cpu_operations(*, mpi_enabled: bool, cpu_operations: str | None) -> None:
    """The MPI controller with Gloo CPU operations crashes (both strategies).

    Under ``mpirun``/``horovodrun --mpi`` with ``HOROVOD_CPU_OPERATIONS=gloo`` Horovod's Gloo collectives
    segfault (seen here in the first broadcast; an Adasum allreduce still runs over MPI, then the next
    allgather crashes). Gloo operations need the Gloo controller.

    Args:
        mpi_enabled: ``hvd.mpi_enabled()`` (the MPI controller is in use).
        cpu_operations: the ``HOROVOD_CPU_OPERATIONS`` environment variable (None when unset).

    Raises:
        AdasumConfigurationError: MPI controller with ``HOROVOD_CPU_OPERATIONS=gloo``.
    """
    if mpi_enabled and cpu_operations is not None and cpu_operations.strip().lower() == "gloo":
        raise AdasumConfigurationError(
            "HOROVOD_CPU_OPERATIONS=gloo under the MPI controller (mpirun / horovodrun --mpi): Horovod's "
            "Gloo collectives crash there (segmentation fault). Unset HOROVOD_CPU_OPERATIONS (or set it to "
            "mpi), or launch with horovodrun --gloo and strategy='horovod'."
        )


def check_precision(precision: str) -> None:
    """fp16 mixed precision (GradScaler) cannot work with Adasum.

    The scaler unscales gradients and skips steps with inf/NaN *after* backward, but Horovod's Adasum
    optimizer has already taken the local step inside backward on the scaled gradients (Horovod #3429:
    NaN loss). ``"bf16-mixed"`` needs no scaler and works.

    Raises:
        AdasumConfigurationError: for ``"16-mixed"`` (Lightning's name for ``precision=16``).
    """
    if str(precision) in ("16-mixed", "16"):
        raise AdasumConfigurationError(
            "horovod_adasum cannot use precision='16-mixed': its gradient scaler unscales gradients and "
            "skips overflowing steps after backward, but Adasum's local step already ran inside backward "
            "on the scaled gradients (NaN loss, Horovod #3429). Use precision='bf16-mixed', or "
            "strategy='horovod'."
        )


def check_gradient_clipping(value: float | None, algorithm: str | None) -> None:
    """Norm clipping cannot take effect with Adasum; value clipping is applied inside the hook.

    Clipping by norm needs the norm over all parameters before any update, but Adasum updates each
    parameter as soon as its gradient is ready. Clipping by value is per element, so the strategy
    applies it to each gradient right before that parameter's local step.

    Raises:
        AdasumConfigurationError: ``gradient_clip_val`` set with ``gradient_clip_algorithm="norm"``.
    """
    if value is None or float(value) <= 0:
        return
    if str(algorithm or "norm").lower() == "norm":
        raise AdasumConfigurationError(
            f"horovod_adasum cannot clip gradients by norm (gradient_clip_val={value}): Adasum's local step "
            "updates each parameter inside backward, before the norm over all parameters is known. Use "
            "gradient_clip_algorithm='value' (applied to each gradient before its local step), or "
            "strategy='horovod'."
        )


def check_gradient_predivide_factor(factor: float) -> None:
    """``gradient_predivide_factor`` splits an *average*; Adasum has none.

    Raises:
        AdasumConfigurationError: for any factor other than 1.
    """
    if float(factor) != 1.0:
        raise AdasumConfigurationError(
            f"horovod_adasum cannot use gradient_predivide_factor={factor}: it splits gradient averaging and "
            "Adasum does not average (Horovod raises deep inside otherwise). Leave it at 1, or use "
            "strategy='horovod'."
        )


def check_single_device(tensors: Iterable[torch.Tensor]) -> None:
    """One process drives one device: every parameter and buffer must be on the same device.

    Raises:
        AdasumConfigurationError: naming the devices found.
    """
    devices = sorted({str(t.device) for t in tensors})
    if len(devices) > 1:
        raise AdasumConfigurationError(
            f"Horovod strategies run one process per device, but this module's parameters span {devices}. "
            "Keep the whole module on one device (Lightning moves it to cuda:<local rank> or cpu) and start "
            "one process per GPU with horovodrun."
        )


def unreadable_checkpoint(path: object, err: BaseException, rank: int) -> RuntimeError:
    """The error for a checkpoint file that exists but cannot be loaded (truncated, corrupt, foreign)."""
    first_line = (str(err).splitlines() or [""])[0][:200]
    return RuntimeError(
        f"checkpoint {path} could not be read on rank {rank} ({type(err).__name__}: {first_line}). "
        "It is truncated, corrupt or not a Lightning checkpoint: pass another ckpt_path, or ckpt_path=None "
        "to start from scratch."
    )


#: What ``torch.load`` raises for a file it cannot read.
CHECKPOINT_READ_ERRORS = (pickle.UnpicklingError, EOFError, RuntimeError, ValueError, OSError)
