"""What the strategies of both Lightning APIs (Trainer and Fabric) share, written once and Lightning-free.

The functions take the strategy they serve as it is: a Trainer or Fabric strategy has the same
``strategy_name``, ``global_rank``, ``cluster_environment``, ``num_processes``, ``num_nodes`` and
``broadcast``. :class:`HorovodProcess` is the part of a Horovod strategy that both APIs write the same way.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning_utilities.core.rank_zero import rank_zero_only, rank_zero_warn
from torch import Tensor
from torch.nn import Module, SyncBatchNorm
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from adasum_lightning import validation
from adasum_lightning.horovod_support import agree_on_process_group, check_adasum_world, import_horovod
from adasum_lightning.launchers import detect_launcher
from adasum_lightning.local_sgd import PeriodicSync
from adasum_lightning.reporting import reported_on_every_rank

__all__ = [
    "HorovodProcess",
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


def named_parameters(
    optimizer: Optimizer, index: int, names: Mapping[Tensor, str]
) -> list[tuple[str, Tensor]]:
    """(name, parameter) for ``optimizer``'s parameters, in group order: the names of Horovod's allreduce
    operations. A parameter ``names`` lacks is called ``optimizer<index>.group<g>.param<j>``."""
    return [
        (names.get(p, f"optimizer{index}.group{g}.param{j}"), p)
        for g, group in enumerate(optimizer.param_groups)
        for j, p in enumerate(group["params"])
    ]


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


class HorovodProcess:
    """One process per device, started by ``horovodrun``/``mpirun``: Horovod's start, its launch rules, the
    ``torch.distributed`` process group beside it, its optimizer wrapper and its learning-rate policy.

    Mixed in before a Lightning ``DDPStrategy`` (Trainer's or Fabric's), whose process group then carries
    Lightning's own collectives. The class sets ``strategy_name`` and ``reduction`` (Horovod's op name,
    ``"Average"`` or ``"Adasum"``); ``__init__`` sets ``compression`` and ``gradient_predivide_factor``.
    """

    strategy_name: str
    #: Horovod op name of the optimizer wrapper: ``"Average"`` or ``"Adasum"``.
    reduction: str = "Average"
    #: The Lightning API, for messages: ``"Trainer"`` or ``"Fabric"``.
    api: str = "Trainer"
    compression: str
    gradient_predivide_factor: float
    _hvd: Any = None
    _requested_devices: int = 1

    @property
    def hvd(self) -> Any:
        """The ``horovod.torch`` module, imported on first use (:func:`~adasum_lightning.horovod_support.
        import_horovod` names the fix when it is missing)."""
        if self._hvd is None:
            self._hvd = import_horovod()
        return self._hvd

    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices
        return devices[0] if devices else torch.device("cpu")

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        # Whatever ``devices`` Lightning was given (e.g. "auto": every GPU of the node), this process drives
        # one: cuda:<local rank>, or the CPU. The requested count is kept for the launch check.
        if devices:
            self._requested_devices = len(devices)
            kind = torch.device(devices[0]).type
            devices = [torch.device("cuda", self.local_rank)] if kind == "cuda" else [torch.device(kind)]
        self._parallel_devices = devices

    def _configure_launcher(self) -> None:
        self._launcher = None  # horovodrun / mpirun start the processes

    def setup_environment(self) -> None:
        """``hvd.init()``, the launch rules, then the ``torch.distributed`` process group at the address and
        port rank 0 picks and Horovod broadcasts (``MASTER_ADDR``/``MASTER_PORT`` when set).

        Raises:
            AdasumConfigurationError: on every rank, before the first collective (a bad launch can crash or
                hang in one): a process Horovod sees alone though more were started or ``devices`` > 1, the
                rules of :meth:`_validate_environment`, a loopback address for a job on several hosts.
        """
        hvd = self.hvd
        hvd.init()
        rank_zero_only.rank = hvd.rank()
        with reported_on_every_rank(hvd.rank()):
            validation.check_launch(
                hvd.size(),
                detect_launcher(),
                self._requested_devices,
                api=self.api,
                strategy_name=self.strategy_name,
            )
            self._validate_environment()
        self.num_nodes = agree_on_process_group(hvd, self.cluster_environment)
        super().setup_environment()  # type: ignore[misc]

    def _validate_environment(self) -> None:
        """Rules on the launch, right after ``hvd.init()``; under Adasum its world rules (a warning on rank 0
        where Horovod's Adasum works but not as the docs describe)."""
        validation.check_cpu_operations(
            mpi_enabled=self.hvd.mpi_enabled(),
            cpu_operations=os.environ.get("HOROVOD_CPU_OPERATIONS"),
            strategy_name=self.strategy_name,
        )
        if self.reduction == "Adasum":
            warning = check_adasum_world(self.hvd, self.root_device.type)
            if warning:
                rank_zero_warn(warning)

    def _auto_lr_factor(self) -> float:
        """``lr_scaling="auto"``: the world size for averaging (pytorch-lightning 1.x's Horovod strategy);
        for Adasum 1, or ``hvd.local_size()`` on GPU with a NCCL-built Horovod, whose Adasum averages inside a
        node (Horovod's ``docs/adasum_user_guide.rst``)."""
        if self.reduction == "Average":
            return float(self.world_size)
        on_gpu = self.root_device.type == "cuda"
        return float(self.hvd.local_size()) if on_gpu and self.hvd.nccl_built() else 1.0

    def _horovod_optimizer(
        self, optimizer: Optimizer, named: list[tuple[str, Tensor]], backward_passes_per_step: int
    ) -> Optimizer:
        """``optimizer`` wrapped in ``hvd.DistributedOptimizer`` with this strategy's op and compression."""
        hvd = self.hvd
        return hvd.DistributedOptimizer(
            optimizer,
            named_parameters=named,
            compression=hvd.Compression.fp16 if self.compression == "fp16" else hvd.Compression.none,
            op=getattr(hvd, self.reduction),
            backward_passes_per_step=backward_passes_per_step,
            gradient_predivide_factor=self.gradient_predivide_factor,
        )
