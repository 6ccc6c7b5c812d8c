"""A Lightning cluster environment that reads ranks from Horovod (or, before ``hvd.init()``, from MPI)."""

from __future__ import annotations

import os

from lightning_fabric.plugins.environments import ClusterEnvironment
from lightning_fabric.plugins.environments.lightning import find_free_network_port
from typing_extensions import override

from adasum_lightning.launchers import (
    detect_launcher,
    launcher_local_rank,
    launcher_local_size,
    launcher_rank,
    launcher_world_size,
)

__all__ = ["HorovodEnvironment"]


def _hvd_initialized():
    try:
        import horovod.torch as hvd
    except ImportError:
        return None
    return hvd if hvd.is_initialized() else None


class HorovodEnvironment(ClusterEnvironment):
    """Ranks and sizes from Horovod once it is initialised, from the launcher's variables before.

    The launcher (``horovodrun``, ``mpirun``, Azure ML) creates the processes. Reading a rank never
    initialises Horovod: the strategy calls ``hvd.init()`` when fitting starts (``fabric.launch()`` under
    Fabric). :attr:`main_address` and :attr:`main_port` are where the ``torch.distributed`` group beside
    Horovod meets, set by the strategy after ``hvd.init()``; before, ``MASTER_ADDR``/``MASTER_PORT`` or
    ``127.0.0.1`` and 0.
    """

    def __init__(self) -> None:
        super().__init__()
        self._main_address: str | None = None
        self._main_port: int | None = None
        self._node_rank: int | None = None

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return True

    @property
    @override
    def main_address(self) -> str:
        if self._main_address is not None:
            return self._main_address
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    @override
    def main_port(self) -> int:
        if self._main_port is not None:
            return self._main_port
        return int(os.environ.get("MASTER_PORT", 0))

    @staticmethod
    def free_port() -> int:
        """A free TCP port on this host for rank 0's store: Lightning's ``find_free_network_port``."""
        return find_free_network_port()

    def set_main_address_and_port(self, address: str, port: int) -> None:
        """Where rank 0 hosts the process group's TCP store (set by the strategy after ``hvd.init()``)."""
        self._main_address, self._main_port = address, int(port)

    @staticmethod
    @override
    def detect() -> bool:
        launcher = detect_launcher()
        return launcher is not None and launcher.horovod

    @override
    def world_size(self) -> int:
        hvd = _hvd_initialized()
        return hvd.size() if hvd else launcher_world_size()

    @override
    def set_world_size(self, size: int) -> None:
        pass  # fixed by the launcher

    @override
    def global_rank(self) -> int:
        hvd = _hvd_initialized()
        return hvd.rank() if hvd else launcher_rank()

    @override
    def set_global_rank(self, rank: int) -> None:
        pass  # fixed by the launcher

    @override
    def local_rank(self) -> int:
        hvd = _hvd_initialized()
        return hvd.local_rank() if hvd else launcher_local_rank()

    def local_world_size(self) -> int:
        """Processes on this node (Horovod's local size)."""
        hvd = _hvd_initialized()
        return hvd.local_size() if hvd else launcher_local_size()

    @override
    def node_rank(self) -> int:
        """The index of this process's host among the job's hosts, in the order of their lowest rank.

        Set by the strategy after ``hvd.init()`` (Horovod's ``cross_rank`` is not a node rank when hosts run
        different numbers of processes); before that, rank ÷ processes per node.
        """
        if self._node_rank is not None:
            return self._node_rank
        return self.global_rank() // max(1, self.local_world_size())

    def set_node_rank(self, node_rank: int) -> None:
        self._node_rank = int(node_rank)
