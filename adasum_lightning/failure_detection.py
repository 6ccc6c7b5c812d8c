"""The launch settings that end a multi-host job when a host is lost, and give the ranks time on SIGTERM.

``adasum-horovodrun``, ``make demo`` and the Azure ML jobs apply them; why each, and the measurements behind
the numbers: docs/launching.md, "A lost host".
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

#: Open MPI MCA parameters that end the job about 30 s after a host becomes unreachable: keepalive probes
#: after 10 s of silence, every 5 s, 4 unanswered (10 + 4 × 5 s; Open MPI's defaults give 480 s).
MPI_FAULT_SETTINGS: dict[str, str] = {
    "oob_tcp_keepalive_time": "10",
    "oob_tcp_keepalive_intvl": "5",
    "oob_tcp_keepalive_probes": "4",
    # Seconds between SIGCONT, SIGTERM and SIGKILL when mpirun stops the ranks (default 1 s): checkpoint time.
    "odls_base_sigkill_timeout": "5",
}


def mpirun_mca_args(settings: Mapping[str, str] = MPI_FAULT_SETTINGS) -> list[str]:
    """``mpirun`` arguments for ``settings``: ``["--mca", name, value, ...]``."""
    return [item for name, value in settings.items() for item in ("--mca", name, str(value))]


def horovodrun_mpi_args(settings: Mapping[str, str] = MPI_FAULT_SETTINGS) -> str:
    """The same for ``horovodrun --mpi-args="..."`` (one string; append other Open MPI options to it)."""
    return " ".join(mpirun_mca_args(settings))


def mpi_env(settings: Mapping[str, str] = MPI_FAULT_SETTINGS) -> dict[str, str]:
    """The same as environment variables (``OMPI_MCA_<name>``) for the launcher's environment.

    ``mpirun`` passes them to the other hosts' daemons, so exporting them where it starts is enough; a value
    on the command line wins over the variable.
    """
    return {f"OMPI_MCA_{name}": str(value) for name, value in settings.items()}


#: Process-group timeout of the torch.distributed strategies (``DDPStrategy(timeout=...)``): a collective
#: waiting this long for a peer raises. It also bounds legitimate waits (a barrier while rank 0 writes a
#: checkpoint): raise it if one rank can be busy alone for longer. torch's Gloo default: 30 minutes.
DDP_PROCESS_GROUP_TIMEOUT = datetime.timedelta(seconds=30)

#: ``torchrun`` arguments: when a worker fails, the agent waits this long from SIGTERM to SIGKILL for the
#: others (default 30 s); a rank blocked in a collective cannot run a signal handler anyway.
TORCHRUN_FAULT_ARGS: tuple[str, ...] = ("--shutdown-timeout", "5")

#: Process-group timeout of the elastic recipe (docs/elastic.md): the survivors of a lost node fail their
#: collective after this long and their agent restarts them; keep it above the longest legitimate wait.
ELASTIC_PROCESS_GROUP_TIMEOUT = datetime.timedelta(seconds=15)

#: ``torchrun`` arguments of the elastic recipe (with ``--nnodes MIN:MAX --max-restarts K``): the fault
#: arguments, and a rendezvous that closes 5 s after the smallest world has joined (c10d default 30 s).
TORCHRUN_ELASTIC_ARGS: tuple[str, ...] = (*TORCHRUN_FAULT_ARGS, "--rdzv-conf", "last_call_timeout=5")

#: The environment of each node's ``torchrun`` in the elastic recipe: the workers' store is made afresh for
#: every rendezvous round (by default torchrun's agent keeps one store across rounds, and a restarted worker
#: can read a peer address its failed predecessor left there: "Gloo connectFullMesh failed").
TORCHRUN_ELASTIC_ENV: dict[str, str] = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

#: ``net.ipv4.tcp_retries2`` for every node of a ``torchrun`` job: unacknowledged TCP data fails after about
#: 25 s ((2^7 − 1) × 200 ms) instead of about 15 minutes (Linux's 15), ending an agent that lost its store.
TCP_RETRIES2 = 6


def tcp_retries2_sysctl(value: int = TCP_RETRIES2) -> list[str]:
    """The command that applies :data:`TCP_RETRIES2` on a node (root; per network namespace)."""
    return ["sysctl", "-w", f"net.ipv4.tcp_retries2={value}"]
