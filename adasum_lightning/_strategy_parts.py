"""What the strategies of both Lightning APIs (Trainer and Fabric) share, written once and Lightning-free.

The functions take the strategy they serve as it is: a Trainer or Fabric strategy has the same
``strategy_name``, ``global_rank``, ``cluster_environment``, ``num_processes``, ``num_nodes`` and
``broadcast``. The Horovod strategies' share is :class:`adasum_lightning.horovod.process.HorovodProcess`.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.nn import Module, SyncBatchNorm
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from adasum_lightning import validation
from adasum_lightning.local_sgd import PeriodicSync
from adasum_lightning.reporting import reported_on_every_rank

__all__ = [
    "ReplicaMesh",
    "check_launcher_world_size",
    "close_windows",
    "make_parameters_contiguous",
    "periodic_sync",
    "prepare_unwrapped_module",
    "register",
    "sampler_seed",
]


def register(strategy_registry: Any, strategy: type) -> None:
    """Add ``strategy`` to a Lightning strategy registry under its ``strategy_name``, described by the first
    line of its docstring (replacing an earlier entry of that name)."""
    description = (strategy.__doc__ or "").splitlines()[0]
    strategy_registry.register(strategy.strategy_name, strategy, description=description, override=True)


def check_launcher_world_size(strategy: Any, api: str) -> None:
    """Under an outside launcher that sets ``WORLD_SIZE`` (torchrun, SLURM, Azure ML), check that
    ``devices × num_nodes`` describes it; call before the rendezvous, which a mismatch would leave waiting.

    Raises:
        AdasumConfigurationError: on every rank, naming the ``devices``/``num_nodes`` that match.
    """
    environment = strategy.cluster_environment
    if environment is None or not environment.creates_processes_externally:
        return
    world_size = os.environ.get("WORLD_SIZE", "")
    if world_size.isdigit():
        with reported_on_every_rank(strategy.global_rank):
            validation.check_launcher_world_size(
                int(world_size),
                strategy.num_processes,
                strategy.num_nodes,
                api=api,
                strategy_name=strategy.strategy_name,
            )


def sampler_seed(strategy: Any) -> int:
    """Rank 0's ``seed_everything`` seed, for every rank's ``DistributedSampler`` (a broadcast: every rank
    calls this). Ranks seeded differently, to vary dropout or augmentation, would otherwise shuffle with
    different permutations and read overlapping shards."""
    return int(strategy.broadcast(int(os.environ.get("PL_GLOBAL_SEED", 0)), src=0))


def make_parameters_contiguous(module: Module) -> None:
    """Give each non-contiguous parameter a contiguous copy of its values (the same ``Parameter`` object):
    the update reductions work on parameters in place."""
    for param in module.parameters():
        if not param.data.is_contiguous():
            param.data = param.data.contiguous()


def prepare_unwrapped_module(strategy: Any, module: Module) -> None:
    """Check ``module`` for a strategy that reduces updates itself, then give every rank the first rank's
    parameters and buffers (``fabric.setup`` under those strategies; no ``DistributedDataParallel``).

    Raises:
        AdasumConfigurationError: on every rank — a module already wrapped in ``DistributedDataParallel``,
            on several devices, or with ``SyncBatchNorm`` layers on CPU.
    """
    from adasum_lightning.step import broadcast_from_rank_zero

    name = strategy.strategy_name
    with reported_on_every_rank(strategy.global_rank):
        validation.check_module_unwrapped(name, isinstance(module, DistributedDataParallel))
        validation.check_single_device(name, [*module.parameters(), *module.buffers()])
        sync_layers = [n for n, m in module.named_modules() if isinstance(m, SyncBatchNorm)]
        validation.check_sync_batchnorm(strategy.root_device.type, False, sync_layers, name)
    make_parameters_contiguous(module)
    broadcast_from_rank_zero([*module.parameters(), *module.buffers()])


def periodic_sync(
    strategy: Any,
    optimizer: Optimizer,
    restored: dict[str, Any] | None,
    timeout: timedelta | None,
    overlap_group: dist.ProcessGroup | None,
) -> PeriodicSync:
    """``optimizer``'s local-SGD windows under ``strategy``'s ``sync_every``, ``combine``, ``outer_optimizer``
    (None, or a callable that builds it from the parameters), ``wire_dtype`` and ``overlap_sync`` (its
    exchanges on ``overlap_group``), restored from ``restored``.

    Raises:
        AdasumConfigurationError: on every rank, an outer optimizer over other parameters.
    """
    from adasum_lightning.step import optimizer_parameters

    params = optimizer_parameters(optimizer)
    outer = None
    if strategy.outer_optimizer is not None:
        outer = strategy.outer_optimizer(params)
        with reported_on_every_rank(strategy.global_rank):
            validation.check_outer_optimizer(
                strategy.strategy_name,
                [id(p) for p in params],
                [id(p) for p in optimizer_parameters(outer)],
                builder=True,
            )
    built = PeriodicSync(
        params,
        strategy.sync_every,
        strategy.combine,
        outer,
        timeout=timeout,
        wire_dtype=strategy.wire_dtype,
        overlap_sync=strategy.overlap_sync,
        overlap_group=overlap_group,
    )
    if restored is not None:
        built.load_state_dict(restored)
    return built


def close_windows(windows: dict[int, PeriodicSync]) -> None:
    """End the worker threads of ``windows`` (:meth:`PeriodicSync.close`) and forget them."""
    for built in windows.values():
        built.close()
    windows.clear()


class ReplicaMesh:
    """The 2-D ``("replicate", "shard")`` mesh of both APIs' ``fsdp_adasum``: replica groups of ``shard_size``
    ranks, row-major (ranks 0…S−1 are group 0); FSDP2 shards over ``mesh["shard"]``."""

    strategy_name: str
    shard_size: int | None
    _device_mesh: Any = None

    @property
    def device_mesh(self) -> Any:
        """The ``DeviceMesh``, built when the processes start (:meth:`_build_mesh`).

        Raises:
            RuntimeError: before the processes started (``fabric.launch()``, ``Trainer.fit``).
        """
        if self._device_mesh is None:
            raise RuntimeError(f"{self.strategy_name}'s device mesh is built when the processes start")
        return self._device_mesh

    @property
    def replicate_group(self) -> dist.ProcessGroup:
        """This rank's group of replicas (one rank per replica group, at this rank's shard position)."""
        return self.device_mesh.get_group("replicate")

    @property
    def shard_group(self) -> dist.ProcessGroup:
        """The ranks of this rank's replica group (FSDP2 shards over them)."""
        return self.device_mesh.get_group("shard")

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """``(replica groups, shard_size)``."""
        groups, shard = self.device_mesh.shape
        return groups, shard

    def _build_mesh(self) -> None:
        """The mesh of ``shard_size`` ranks per group (default: the processes per node); call once the
        process group exists.

        Raises:
            AdasumConfigurationError: on every rank, a ``shard_size`` that does not divide the world size.
        """
        from torch.distributed.device_mesh import init_device_mesh

        shard = self.shard_size if self.shard_size is not None else self.num_processes
        with reported_on_every_rank(self.global_rank):
            validation.check_shard_size(self.world_size, shard, self.strategy_name)
        shape = (self.world_size // shard, shard)
        self._device_mesh = init_device_mesh(
            self.root_device.type, shape, mesh_dim_names=validation.ADASUM_MESH_DIMS
        )
