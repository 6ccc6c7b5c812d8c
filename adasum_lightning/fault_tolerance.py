"""Fault-tolerance settings: the launch settings that end a multi-host job when a host is lost (instead of
every rank waiting in an allreduce) and give the ranks time to stop on SIGTERM, in one place.

``adasum-horovodrun``, ``make demo`` and the Azure ML jobs apply them. Why each one, and the measurements
behind the numbers (two hosts emulated on one machine, ``tests/test_two_hosts.py``): ``docs/launching.md``,
"A lost host".
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
    "TCP_RETRIES2",
    "tcp_retries2_sysctl",
]

#: Open MPI MCA parameters (name → value) that end the whole job at most about 30 s after a host becomes
#: unreachable: the OOB connection to a host is probed after 10 s of silence, every 5 s, and declared dead
#: after 4 unanswered probes (10 + 4 × 5 = 30 s). Open MPI's defaults are 300 s / 20 s / 9 (480 s).
MPI_FAULT_SETTINGS: dict[str, str] = {
    "oob_tcp_keepalive_time": "10",
    "oob_tcp_keepalive_intvl": "5",
    "oob_tcp_keepalive_probes": "4",
    # When mpirun stops the ranks (SIGTERM to mpirun, a preemption, a failed rank): SIGCONT, then SIGTERM
    # after this many seconds, then SIGKILL after as many again (Open MPI's default, 1 s, leaves Lightning
    # 1 s to finish the step and write an OnExceptionCheckpoint).
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

    ``mpirun`` reads them and passes them to the ``orted`` daemons of the other hosts on their command
    line, and every rank sees them in its environment (checked on two hosts), so exporting them where
    ``mpirun``/``horovodrun`` starts is enough, e.g. in a job definition that builds the ``mpirun`` itself.
    Open MPI documents that a value given on the command line wins over the variable.
    """
    return {f"OMPI_MCA_{name}": str(value) for name, value in settings.items()}


#: Process-group timeout for torch.distributed strategies (Lightning: ``DDPStrategy(timeout=...)``): a
#: collective that waits this long for a peer raises, and the rank exits. It also bounds legitimate
#: waits, e.g. every rank waiting at a barrier while rank 0 writes a checkpoint: raise it if one rank
#: can be busy alone for longer. torch's default for Gloo is 30 minutes.
DDP_PROCESS_GROUP_TIMEOUT = datetime.timedelta(seconds=30)

#: ``torchrun`` arguments: when a worker fails, the agent sends SIGTERM to the others and waits this long
#: before SIGKILL (default 30 s). A rank blocked inside a collective cannot run a Python signal handler
#: (Lightning's included), so it only ends when the collective fails (docs/launching.md).
TORCHRUN_FAULT_ARGS: tuple[str, ...] = ("--shutdown-timeout", "5")

#: ``net.ipv4.tcp_retries2`` for every node of a ``torchrun`` job: a TCP connection whose data stays
#: unacknowledged fails after about 25 s ((2^7 − 1) × 200 ms of retransmissions) instead of the Linux
#: default 15 (about 15 minutes). Ends the agent that lost the rendezvous store (docs/launching.md,
#: "A lost host").
TCP_RETRIES2 = 6


def tcp_retries2_sysctl(value: int = TCP_RETRIES2) -> list[str]:
    """The command that applies :data:`TCP_RETRIES2` on a node (root; per network namespace)."""
    return ["sysctl", "-w", f"net.ipv4.tcp_retries2={value}"]
