"""Horovod without Lightning: importing it, the build command when it is missing, and the rules of its launch,
its Adasum and its optimizer (read from Horovod 0.28.1).
"""

from __future__ import annotations

import importlib.resources
import inspect
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.optim import Optimizer

from adasum_lightning.errors import AdasumConfigurationError
from adasum_lightning.launch_environment import DetectedLauncher
from adasum_lightning.reference import is_power_of_two, nearest_powers_of_two

__all__ = [
    "HOROVOD_BUILD_PACKAGE",
    "missing_horovod_message",
    "import_horovod",
    "needs_closure",
    "check_launch",
    "check_controller",
    "check_cpu_operations",
    "check_world_size",
    "check_nccl_topology",
    "check_compression",
    "check_gradient_predivide_factor",
    "check_no_local_sgd",
    "check_precision",
    "check_gradient_clipping",
    "check_closure_optimizers",
    "check_horovod_dtypes",
    "check_skipped_backward_passes",
    "clipping_refused",
]


#: The package of Horovod's build script and patch: ``patches/`` in a checkout, package data in a wheel.
HOROVOD_BUILD_PACKAGE = "adasum_lightning.aml.horovod_build"


def missing_horovod_message(
    what: str, alternative: str = "strategy='ddp_adasum'", python: str | None = None
) -> str:
    """The message for a missing Horovod: the build script's command, or ``alternative``."""
    python = python or sys.executable
    try:
        script = importlib.resources.files(HOROVOD_BUILD_PACKAGE).joinpath("build_horovod.sh")
    except ModuleNotFoundError:  # a checkout on sys.path, not installed: the package is its patches/ folder
        script = Path(__file__).resolve().parents[2] / "patches" / "build_horovod.sh"
    return (
        f"{what} is not installed in the environment of {python}. Build Horovod against its torch with "
        f"`bash {script} --python {python}` (it needs Open MPI: the Debian/Ubuntu packages openmpi-bin and "
        f"libopenmpi-dev), or use {alternative}, which needs no Horovod."
    )


def import_horovod() -> Any:
    """Import ``horovod.torch``, or raise an ``ImportError`` that names the build command."""
    try:
        import horovod.torch as hvd
    except ImportError as err:
        raise ImportError(missing_horovod_message(f"Horovod with PyTorch support ({err})")) from err
    return hvd


def needs_closure(optimizer: Optimizer) -> bool:
    """True when the wrapped optimizer's ``step`` requires a ``closure`` (e.g. LBFGS)."""
    for cls in type(optimizer).__mro__:
        if "step" in vars(cls) and not cls.__module__.startswith("horovod."):
            try:
                parameter = inspect.signature(vars(cls)["step"]).parameters.get("closure")
            except (TypeError, ValueError):
                return False
            return parameter is not None and parameter.default is inspect.Parameter.empty
    return False


def _sizes(n: int) -> str:
    return " or ".join(str(v) for v in nearest_powers_of_two(n))


def check_launch(
    horovod_size: int,
    launcher: DetectedLauncher | None,
    requested_devices: int,
    api: str = "Trainer",
    strategy_name: str = "a Horovod strategy",
) -> None:
    """A world of 1 under a launcher that started N > 1 processes, or ``devices`` > 1. Raises
    ``AdasumConfigurationError``: naming the launcher seen and ``horovodrun -np N``."""
    if horovod_size != 1:
        return
    if launcher is not None and launcher.processes > 1:
        raise AdasumConfigurationError(
            f"{launcher.name} started {launcher.processes} processes "
            f"({launcher.variable}={launcher.processes}), but Horovod sees a world of 1 in each, so each "
            f"would train alone. {strategy_name} needs an MPI "
            f"launcher: `horovodrun -np {launcher.processes} python SCRIPT ...` (or `mpirun -np "
            f"{launcher.processes} ...`), or use strategy='ddp_adasum', which {launcher.name} can start."
        )
    if requested_devices > 1:
        seen = "no launcher (a plain `python` start)" if launcher is None else launcher.name
        raise AdasumConfigurationError(
            f"{api}(devices={requested_devices}) asks for {requested_devices} devices, but this process was "
            f"started by {seen} and Horovod sees a world of 1; {strategy_name} never starts processes "
            f"themselves. Launch `horovodrun -np {requested_devices} python SCRIPT ...` with devices=1 (one "
            "process per device), or use strategy='ddp_adasum', which starts the processes itself."
        )


def check_controller(*, mpi_built: bool, mpi_enabled: bool, gloo_enabled: bool) -> None:
    """Adasum exists for Horovod's MPI controller only. Raises ``AdasumConfigurationError``: Horovod without
    MPI, or the Gloo controller."""
    if not mpi_built:
        raise AdasumConfigurationError(
            "horovod_adasum needs Horovod built with MPI: rebuild it with `make setup` (HOROVOD_WITH_MPI=1), "
            "or use strategy='horovod'."
        )
    if gloo_enabled or not mpi_enabled:
        raise AdasumConfigurationError(
            "horovod_adasum needs the MPI controller, but this job runs under Gloo (horovodrun --gloo): "
            "launch `horovodrun --mpi -np N ...` or `mpirun -np N ...`, or use strategy='horovod'."
        )


def check_cpu_operations(
    *, mpi_enabled: bool, cpu_operations: str | None, strategy_name: str = "a Horovod strategy"
) -> None:
    """Gloo CPU operations under the MPI controller crash Horovod in a collective. Raises
    ``AdasumConfigurationError``: ``HOROVOD_CPU_OPERATIONS=gloo`` under MPI."""
    if mpi_enabled and cpu_operations is not None and cpu_operations.strip().lower() == "gloo":
        raise AdasumConfigurationError(
            f"{strategy_name} cannot run with HOROVOD_CPU_OPERATIONS=gloo under the MPI controller (it "
            "crashes Horovod): unset HOROVOD_CPU_OPERATIONS, or launch horovodrun --gloo, strategy='horovod'."
        )


def check_world_size(size: int) -> None:
    """CPU (MPI) Adasum needs a power-of-2 world size. Raises ``AdasumConfigurationError``: naming the nearest
    valid sizes."""
    if not is_power_of_two(size):
        raise AdasumConfigurationError(
            f"horovod_adasum needs a world size that is a power of 2 (1, 2, 4, 8, …) for Adasum over MPI; "
            f"this job has {size} processes. Launch {_sizes(size)} processes (horovodrun -np N), or use "
            f"strategy='horovod' (gradient averaging), which takes any size."
        )


def check_nccl_topology(size: int, local_sizes: Sequence[int]) -> str | None:
    """NCCL Adasum needs power-of-2 nodes of the same power-of-2 GPU count (``local_sizes``: per rank);
    returns a warning for a single node, else None. Raises ``AdasumConfigurationError`` otherwise."""
    distinct = sorted(set(local_sizes))
    if len(distinct) != 1:
        raise AdasumConfigurationError(
            f"horovod_adasum with NCCL needs the same number of processes on every node; found {distinct}: "
            "launch the same GPU count on every node (e.g. horovodrun -H host1:4,host2:4)."
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
            f"horovod_adasum with NCCL on a single node averages its {local} GPUs' updates; the learning "
            f"rate is multiplied by {local}, as for averaging (Horovod applies Adasum only across nodes)."
        )
    return None


def check_compression(compression: str) -> str:
    """Raises ValueError unless ``compression`` is ``"none"`` or ``"fp16"``."""
    if compression not in ("none", "fp16"):
        raise ValueError(f"compression must be 'none' or 'fp16', got {compression!r}")
    return compression


def check_gradient_predivide_factor(factor: float) -> None:
    """Raises AdasumConfigurationError for a factor other than 1: it splits an average, Adasum has none."""
    if float(factor) != 1.0:
        raise AdasumConfigurationError(
            f"horovod_adasum cannot use gradient_predivide_factor={factor} (Adasum does not average): leave "
            "it at 1, or use strategy='horovod'."
        )


def check_no_local_sgd(options: Iterable[str], strategy_name: str) -> None:
    """Raises AdasumConfigurationError for local-SGD ``options``: Horovod reduces in every backward."""
    given = sorted(set(options) & {"sync_every", "combine", "outer_optimizer"})
    if given:
        raise AdasumConfigurationError(
            f"{strategy_name} has no {', '.join(given)}: Horovod's optimizer reduces inside every backward "
            "pass. Local SGD / DiLoCo is ddp_adasum's: DDPAdasumStrategy(sync_every=..., combine=..., "
            "outer_optimizer=...), launched by Lightning, torchrun or SLURM."
        )


def check_precision(precision: str) -> None:
    """Raises AdasumConfigurationError for ``"16-mixed"``: its scaler acts after the local step."""
    if str(precision) in ("16-mixed", "16"):
        raise AdasumConfigurationError(
            "horovod_adasum cannot use precision='16-mixed': its gradient scaler acts after Adasum's local "
            "step ran inside backward. Use precision='bf16-mixed', or strategy='horovod'."
        )


def check_gradient_clipping(value: float | None, algorithm: str | None) -> None:
    """Raises AdasumConfigurationError for norm clipping: the local step runs before the norm is known."""
    if value is None or float(value) <= 0:
        return
    if str(algorithm or "norm").lower() == "norm":
        raise AdasumConfigurationError(
            f"horovod_adasum cannot clip gradients by norm (gradient_clip_val={value}): the local step runs "
            "in backward, before the norm is known. Use gradient_clip_algorithm='value' or "
            "strategy='horovod'."
        )


def check_closure_optimizers(strategy_name: str, optimizers_needing_closure: Sequence[str]) -> None:
    """Raises AdasumConfigurationError for optimizers whose ``step`` needs a closure (run in a hook)."""
    if optimizers_needing_closure:
        names = ", ".join(sorted(set(optimizers_needing_closure)))
        raise AdasumConfigurationError(
            f"{strategy_name} cannot use {names}: its step() needs a closure, and Horovod's Adasum optimizer "
            "steps inside backward without one. Use strategy='ddp_adasum' or strategy='horovod'."
        )


def check_horovod_dtypes(strategy_name: str, device_type: str, dtypes: Iterable[torch.dtype]) -> None:
    """Raises AdasumConfigurationError for bfloat16 parameters on CPU: Horovod's CPU collectives lack it."""
    if device_type == "cpu" and torch.bfloat16 in set(dtypes):
        raise AdasumConfigurationError(
            f"{strategy_name} cannot reduce bfloat16 parameters on CPU (Horovod's CPU collectives lack it). "
            "Use precision='bf16-mixed', or strategy='ddp_adasum'."
        )


def check_skipped_backward_passes(
    strategy_name: str, strategy_class: str, skipped: int, backward_passes_per_step: int
) -> None:
    """Raises AdasumConfigurationError when ``skipped`` ≥ ``backward_passes_per_step`` (hooks never pause)."""
    if skipped < backward_passes_per_step:
        return
    raise AdasumConfigurationError(
        f"{strategy_name} cannot skip the reduction of {skipped} backward pass(es) (no_backward_sync): "
        f"Horovod's hooks reduce after backward_passes_per_step={backward_passes_per_step}. Pass "
        f"Fabric(strategy={strategy_class}(backward_passes_per_step={skipped + 1}))."
    )


def clipping_refused(strategy_name: str, algorithm: str, value: float) -> AdasumConfigurationError:
    """The error for ``fabric.clip_gradients`` under Horovod's Adasum (``algorithm``: "norm" or "value")."""
    what = f"by norm (max_norm={value})" if algorithm == "norm" else f"by value (clip_val={value})"
    return AdasumConfigurationError(
        f"{strategy_name} cannot clip gradients {what}: Horovod's Adasum optimizer steps inside "
        "fabric.backward, before clipping. Use Fabric(strategy='ddp_adasum'), or strategy='horovod'."
    )
