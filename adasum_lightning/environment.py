"""A Lightning cluster environment that reads ranks from Horovod (or, before ``hvd.init()``, from MPI)."""

from __future__ import annotations

import os

from lightning_fabric.plugins.environments import ClusterEnvironment

# Variables set by the launchers, in order of preference: Horovod's own (gloo and elastic launches),
# Open MPI (horovodrun over MPI, mpirun, Azure ML MPI jobs), MPICH / Intel MPI (PMI).
_RANK_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
_SIZE_VARS = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_LOCAL_RANK_VARS = ("HOROVOD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
_LOCAL_SIZE_VARS = ("HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


def _first_int(names: tuple[str, ...], default: int) -> int:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return int(value)
    return default


def launcher_rank() -> int:
    """Global rank as the launcher set it in the environment (0 when not launched by MPI/Horovod)."""
    return _first_int(_RANK_VARS, 0)


def launcher_world_size() -> int:
    """World size as the launcher set it in the environment (1 when not launched by MPI/Horovod)."""
    return _first_int(_SIZE_VARS, 1)


def _hvd_initialized():
    try:
        import horovod.torch as hvd
    except ImportError:
        return None
    return hvd if hvd.is_initialized() else None


class HorovodEnvironment(ClusterEnvironment):
    """Ranks and sizes from Horovod once it is initialised, from the launcher's variables before.

    Processes are created by the launcher (``horovodrun``, ``mpirun``, Azure ML), never by Lightning,
    so :attr:`creates_processes_externally` is True. Reading a rank never initialises Horovod: building
    a ``Trainer`` in a notebook has no side effect; the strategy calls ``hvd.init()`` when fitting starts.
    """

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return os.environ.get("AZ_BATCH_MASTER_NODE", "127.0.0.1").split(":")[0]

    @property
    def main_port(self) -> int:
        return 0  # Horovod does its own rendezvous; Lightning never opens this port.

    @staticmethod
    def detect() -> bool:
        return any(os.environ.get(name) for name in _SIZE_VARS)

    def world_size(self) -> int:
        hvd = _hvd_initialized()
        return hvd.size() if hvd else launcher_world_size()

    def set_world_size(self, size: int) -> None:
        pass  # fixed by the launcher

    def global_rank(self) -> int:
        hvd = _hvd_initialized()
        return hvd.rank() if hvd else launcher_rank()

    def set_global_rank(self, rank: int) -> None:
        pass  # fixed by the launcher

    def local_rank(self) -> int:
        hvd = _hvd_initialized()
        return hvd.local_rank() if hvd else _first_int(_LOCAL_RANK_VARS, 0)

    def local_world_size(self) -> int:
        """Processes on this node (Horovod's local size)."""
        hvd = _hvd_initialized()
        return hvd.local_size() if hvd else _first_int(_LOCAL_SIZE_VARS, 1)

    def node_rank(self) -> int:
        hvd = _hvd_initialized()
        if hvd:
            return hvd.cross_rank()
        return self.global_rank() // max(1, self.local_world_size())
