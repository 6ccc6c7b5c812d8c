"""The launch settings that end a multi-host job when a host is lost, and give the ranks time on SIGTERM.

``adasum-horovodrun``, ``make demo`` and the Azure ML jobs apply them: docs/launching.md, "A lost host".
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping

__all__ = [
    "MPI_FAULT_SETTINGS",
    "mpirun_mca_args",
    "horovodrun_mpi_args",
    "mpi_env",
    "DDP_PROCESS_GROUP_TIMEOUT",
    "TORCHRUN_FAULT_ARGS",
    "ELASTIC_PROCESS_GROUP_TIMEOUT",
    "TORCHRUN_ELASTIC_ARGS",
    "TORCHRUN_ELASTIC_ENV",
    "TCP_RETRIES2",
    "tcp_retries2_sysctl",
]

#: Open MPI MCA parameters: keepalive probes end the job soon after a host becomes unreachable.
MPI_FAULT_SETTINGS: dict[str, str] = {
    "oob_tcp_keepalive_time": "10",
    "oob_tcp_keepalive_intvl": "5",
    "oob_tcp_keepalive_probes": "4",
    # seconds between SIGTERM and SIGKILL when mpirun stops the ranks: time to checkpoint
    "odls_base_sigkill_timeout": "5",
}


def mpirun_mca_args(settings: Mapping[str, str] = MPI_FAULT_SETTINGS) -> list[str]:
    """``mpirun`` arguments for ``settings``: ``["--mca", name, value, ...]``."""
    return [item for name, value in settings.items() for item in ("--mca", name, str(value))]


def horovodrun_mpi_args(settings: Mapping[str, str] = MPI_FAULT_SETTINGS) -> str:
    """The same as one string for ``horovodrun --mpi-args``."""
    return " ".join(mpirun_mca_args(settings))


def mpi_env(settings: Mapping[str, str] = MPI_FAULT_SETTINGS) -> dict[str, str]:
    """The same as ``OMPI_MCA_<name>`` environment variables (``mpirun`` passes them to other hosts)."""
    return {f"OMPI_MCA_{name}": str(value) for name, value in settings.items()}


#: Process-group timeout of the torch.distributed strategies: also bounds legitimate waits (a checkpoint).
DDP_PROCESS_GROUP_TIMEOUT = datetime.timedelta(seconds=30)

#: ``torchrun`` arguments: a short SIGTERM-to-SIGKILL wait (a rank blocked in a collective cannot handle it).
TORCHRUN_FAULT_ARGS: tuple[str, ...] = ("--shutdown-timeout", "5")

#: Process-group timeout of the elastic recipe (docs/elastic.md): survivors of a lost node fail and restart.
ELASTIC_PROCESS_GROUP_TIMEOUT = datetime.timedelta(seconds=15)

#: ``torchrun`` arguments of the elastic recipe: the fault arguments and a short rendezvous last call.
TORCHRUN_ELASTIC_ARGS: tuple[str, ...] = (*TORCHRUN_FAULT_ARGS, "--rdzv-conf", "last_call_timeout=5")

#: Each node's ``torchrun`` environment in the elastic recipe: a fresh store per rendezvous round, so that a
#: restarted worker does not read its failed predecessor's peer address.
TORCHRUN_ELASTIC_ENV: dict[str, str] = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

#: ``net.ipv4.tcp_retries2`` for every node of a ``torchrun`` job: unacknowledged TCP data fails early
#: (Linux's 15), ending an agent that lost its store.
TCP_RETRIES2 = 6


def tcp_retries2_sysctl(value: int = TCP_RETRIES2) -> list[str]:
    """The command that applies :data:`TCP_RETRIES2` on a node (root; per network namespace)."""
    return ["sysctl", "-w", f"net.ipv4.tcp_retries2={value}"]
