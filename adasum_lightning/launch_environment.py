"""What the process launcher told this process, read from the environment (no Horovod, no Lightning).

Open MPI sets ``OMPI_COMM_WORLD_*``, ``horovodrun --gloo`` ``HOROVOD_*``, MPICH / Intel MPI ``PMI_*``;
torchrun, SLURM and Azure ML set ``WORLD_SIZE`` or their own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from adasum_lightning.errors import AdasumConfigurationError, reported_on_every_rank

__all__ = [
    "DetectedLauncher",
    "detect_launcher",
    "launcher_rank",
    "launcher_world_size",
    "launcher_local_rank",
    "launcher_local_size",
    "check_launcher_world_size",
    "check_strategy_world_size",
]

# Variables of the launchers of Horovod jobs, in order of preference: Horovod's own, Open MPI, PMI.
_RANK_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
_SIZE_VARS = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_LOCAL_RANK_VARS = ("HOROVOD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
_LOCAL_SIZE_VARS = ("HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


def _first_int(names: tuple[str, ...], default: int) -> int:
    return next((int(os.environ[name]) for name in names if os.environ.get(name)), default)


def launcher_rank() -> int:
    """Global rank as an MPI or Horovod launcher set it (0 when not launched by one)."""
    return _first_int(_RANK_VARS, 0)


def launcher_world_size() -> int:
    """World size as an MPI or Horovod launcher set it (1 when not launched by one)."""
    return _first_int(_SIZE_VARS, 1)


def launcher_local_rank() -> int:
    """Rank on this node as an MPI or Horovod launcher set it (0 when not launched by one)."""
    return _first_int(_LOCAL_RANK_VARS, 0)


def launcher_local_size() -> int:
    """Processes on this node as an MPI or Horovod launcher set it (1 when not launched by one)."""
    return _first_int(_LOCAL_SIZE_VARS, 1)


@dataclass(frozen=True)
class DetectedLauncher:
    """The launcher that started this process: its name, its world size, the variable that said so, and
    whether it starts Horovod jobs."""

    name: str
    processes: int
    variable: str
    horovod: bool


def detect_launcher(environ: Mapping[str, str] | None = None) -> DetectedLauncher | None:
    """The launcher whose variables are set in ``environ`` (default: ``os.environ``); None if none is."""
    env = os.environ if environ is None else environ

    def size(name: str) -> int | None:
        value = env.get(name, "")
        return int(value) if value.strip().isdigit() else None

    candidates = (
        ("horovodrun --gloo", "HOROVOD_SIZE", True, True),
        ("mpirun / horovodrun (Open MPI)", "OMPI_COMM_WORLD_SIZE", True, True),
        ("mpiexec (MPICH / Intel MPI)", "PMI_SIZE", True, True),
        ("torchrun", "WORLD_SIZE", False, "TORCHELASTIC_RUN_ID" in env),
        ("srun (SLURM)", "SLURM_STEP_NUM_TASKS", False, "SLURM_STEP_ID" in env),
        (
            "a torch.distributed launcher (Lightning's, torch.distributed.launch or Azure ML)",
            "WORLD_SIZE",
            False,
            True,
        ),
    )
    for name, variable, horovod, applies in candidates:
        processes = size(variable)
        if applies and processes is not None:
            return DetectedLauncher(name, processes, variable, horovod)
    return None


def check_launcher_world_size(
    launcher_world_size: int,
    devices: int,
    num_nodes: int,
    api: str = "Trainer",
    strategy_name: str = "ddp_adasum",
) -> None:
    """The launcher's processes are ``devices × num_nodes`` (Lightning's generic environment does not check).
    Raises ``AdasumConfigurationError``: naming both counts."""
    if launcher_world_size != devices * num_nodes:
        raise AdasumConfigurationError(
            f"{strategy_name}: the launcher started {launcher_world_size} processes "
            f"(WORLD_SIZE={launcher_world_size}), but "
            f"the {api} describes devices={devices} × num_nodes={num_nodes} = {devices * num_nodes}. Set "
            f"{api}(devices=<processes per node>, num_nodes=<nodes>) to match the launch."
        )


def check_strategy_world_size(strategy: Any, api: str) -> None:
    """:func:`check_launcher_world_size` under an outside launcher, on every rank, before the rendezvous."""
    environment = strategy.cluster_environment
    if environment is None or not environment.creates_processes_externally:
        return
    world_size = os.environ.get("WORLD_SIZE", "")
    if world_size.isdigit():
        with reported_on_every_rank(strategy.global_rank):
            check_launcher_world_size(
                int(world_size),
                strategy.num_processes,
                strategy.num_nodes,
                api=api,
                strategy_name=strategy.strategy_name,
            )
