"""Launch settings that make a multi-node job end when a node is lost, in one place.

Measured with two hosts on one machine (network namespaces joined by one link, ``tests/twohosts.py``), 4
processes (2 per host), the link cut in the middle of training; "gone" means every process on both hosts
has exited, timed from the cut.

Open MPI (``horovodrun`` / ``mpirun``; strategies ``horovod_adasum`` / ``horovod``)
    With Open MPI's defaults nothing noticed for 8 minutes: everything was gone 481 s after the cut
    (rc 205), exactly Open MPI's out-of-band (OOB) TCP keepalive of 300 s idle + 9 probes × 20 s; until
    then every rank waits inside an allreduce and ``mpirun`` ignores SIGTERM. The keepalive of the OOB
    connection between ``mpirun`` and the ``orted`` daemon of the other host is what ends the job, and
    both ends use it (``mpirun`` passes the settings to every ``orted`` on its command line): ``mpirun``
    aborts ("ORTE has lost communication with a remote daemon. ... Remote daemon: [[job,0],1] on node
    hostB") and the lost host's ``orted`` kills its own ranks, so nothing is orphaned there.
    Two parameters suffice (``oob_tcp_keepalive_time`` 3 and ``oob_tcp_keepalive_intvl`` 1: gone after
    12.9 s = 3 + 9 default probes × 1); :data:`MPI_FAULT_SETTINGS` also sets the probes so that the bound
    reads directly: at most 10 s + 4 × 5 s = 30 s (20–25 s when the channel was already idle and probing
    at the cut, as it is during training). Measured: gone after 23.9–30.7 s as ``horovodrun --mpi-args``
    (6 runs) and 27.1, 29.9, 30.1 s as ``OMPI_MCA_*`` variables for plain ``mpirun``, rc 205 each time.
    3 s / 1 s / 3 probes ended everything in 6.1–8.4 s; the longer bound rides out short network or VM
    stalls. Keepalive probes are answered by the peer's kernel, so
    a busy rank never trips them, only an unreachable host. Horovod's ``HOROVOD_STALL_*`` do not help.

torch.distributed (``torchrun`` + a DDP-family strategy, e.g. Lightning's ``ddp``)
    By default nothing ended within 90 s (Gloo's default process-group timeout is 30 minutes). Three
    settings together ended everything after 29.8–36.4 s (5 runs), both agents rc 1:

    - :data:`DDP_PROCESS_GROUP_TIMEOUT` (Lightning: ``DDPStrategy(timeout=...)``) ends the ranks that wait
      for data from the lost host;
    - :data:`TCP_RETRIES2` (``net.ipv4.tcp_retries2`` on every node) ends the ``torchrun`` agent that lost
      the rendezvous store: its keep-alive thread waits in a ``recv`` without timeout on the store's TCP
      connection (``TCPStore::compareSet``). With the process-group timeout alone the ranks ended but that
      agent was still alive 100–150 s after the cut (``--rdzv-conf read_timeout=10`` did not change it);
      with fewer retransmissions the kernel fails the connection, the agent raises
      ``RendezvousConnectionError`` and exits 1;
    - :data:`TORCHRUN_FAULT_ARGS` (``--shutdown-timeout 5``): without it one run took 55 s, a rank blocked
      in a collective ignored the agent's SIGTERM for 26 s until the default 30 s grace was nearly over.

    ``tcp_retries2`` is a per-network-namespace kernel setting (root: ``sysctl -w``; Docker:
    ``--sysctl net.ipv4.tcp_retries2=6``). It bounds every TCP connection with unacknowledged data on the
    node, so it also covers Open MPI's channels when data is in flight at the moment a host is lost.
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
#: (Lightning's included), so it only ends when the collective fails: seen 26 s after the SIGTERM.
TORCHRUN_FAULT_ARGS: tuple[str, ...] = ("--shutdown-timeout", "5")

#: ``net.ipv4.tcp_retries2`` for every node of a ``torchrun`` job: a TCP connection whose data stays
#: unacknowledged fails after about 25 s ((2^7 − 1) × 200 ms of retransmissions) instead of the Linux
#: default 15 (about 15 minutes). Ends the agent that lost the rendezvous store (see the module docstring).
TCP_RETRIES2 = 6


def tcp_retries2_sysctl(value: int = TCP_RETRIES2) -> list[str]:
    """The command that applies :data:`TCP_RETRIES2` on a node (root; per network namespace)."""
    return ["sysctl", "-w", f"net.ipv4.tcp_retries2={value}"]
