"""``Fabric(strategy="ddp_adasum")``: Adasum of parameter deltas on ``torch.distributed``, in Fabric."""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning_fabric.accelerators import Accelerator
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment, Precision, TorchCheckpointIO
from lightning_fabric.strategies import DDPStrategy
from lightning_fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.constants import default_pg_timeout
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

import adasum_lightning.checkpoint as ckpt
from adasum_lightning._namespaces import register
from adasum_lightning.allreduce import release_workspace
from adasum_lightning.checkpoint import Filter
from adasum_lightning.launch_environment import check_strategy_world_size
from adasum_lightning.local_sgd import (
    PeriodicSync,
    check_outer_optimizer_form,
    check_sync_every,
    close_windows,
    local_sgd_without_outer_message,
    periodic_sync,
)
from adasum_lightning.replicas import prepare_unwrapped_module, sampler_seed
from adasum_lightning.step import check_wire_compression

from . import _compat

__all__ = ["DDPAdasumStrategy"]


class DDPAdasumStrategy(DDPStrategy):
    """Fabric's DDP strategy with Adasum of parameter deltas instead of gradient averaging.

    ``optimizer.step()`` of an optimizer set up by Fabric runs Fabric's local step (the precision plugin,
    including fp16's ``GradScaler``: a step it skips on this rank takes part with a zero update), then every
    rank sets ``θ = θ_before + Adasum(deltas of all ranks)`` (:func:`adasum_lightning.step.adasum_step`):
    the step semantics of the Trainer's ``ddp_adasum`` and of :class:`adasum_lightning.AdasumOptimizer`. Each
    rank keeps its own optimizer state; the learning rate needs no scaling by world size.

    The module is not wrapped in ``DistributedDataParallel``: ``fabric.setup`` gives every rank the first
    rank's parameters and buffers and gradients stay local, so ``fabric.clip_gradients`` clips this rank's
    gradients before its local step and ``fabric.no_backward_sync`` has nothing to skip (gradients accumulate
    until the step). Collectives (``all_gather``, ``all_reduce``, ``broadcast``, ``barrier``), the launcher
    (``fabric.launch()``, ``torchrun``, SLURM) and checkpoints (``fabric.save`` writes on rank 0) are
    ``DDPStrategy``'s.

    Args:
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision: as for ``DDPStrategy``;
            Fabric fills them from its arguments.
        process_group_backend: ``"gloo"`` (CPU default) or ``"nccl"`` (GPU default).
        timeout: how long a collective may wait for the other ranks before this rank fails (default 30 min).
        start_method: how ``fabric.launch()`` starts the processes (``"popen"``, ``"spawn"``, ``"fork"``,
            ``"forkserver"``), as for ``DDPStrategy``.
        sync_every, combine, outer_optimizer, overlap_sync: local SGD / DiLoCo, as for the Trainer's
            ``ddp_adasum`` (``overlap_sync``: each window's exchange behind the next window's steps, applied
            one window late); a window ends early at ``fabric.save``. Call ``fabric.strategy.end_windows()``
            (every rank) before evaluating mid-window and at the end of training.
        compression: None (off), ``"bf16"`` or ``"fp16"``: the dtype of every sent piece, as for the
            Trainer's ``ddp_adasum``.

    Raises:
        AdasumConfigurationError: on every rank, before the first step — a launcher ``WORLD_SIZE`` that
            ``devices × num_nodes`` does not describe, a module on several devices or already wrapped in
            ``DistributedDataParallel``, ``SyncBatchNorm`` layers on CPU; when built, an unknown
            ``compression`` and the local-SGD rules of the Trainer's ``ddp_adasum``.
    """

    strategy_name = "ddp_adasum"

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        sync_every: int = 1,
        combine: str = "adasum",
        outer_optimizer: Callable[[list[torch.Tensor]], Optimizer] | None = None,
        compression: str | None = None,
        overlap_sync: bool = False,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self._backward_sync_control = _LocalGradientsSyncControl()
        check_sync_every(sync_every, combine, self.strategy_name, overlap_sync=overlap_sync)
        check_outer_optimizer_form(self.strategy_name, outer_optimizer, builder=True)
        self.sync_every = int(sync_every)
        self.combine = combine
        self.outer_optimizer = outer_optimizer
        self.compression = compression
        self.wire_dtype = check_wire_compression(compression, self.strategy_name)
        self.overlap_sync = overlap_sync
        self._overlap_group: dist.ProcessGroup | None = None  # overlap_sync's worker thread's
        self._periodic: dict[int, PeriodicSync] = {}  # per optimizer (by id), in the order of first steps
        self._restored_periodic: list[dict[str, Any]] = []

    # ------------------------------------------------------------------------------------------ properties
    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """DDPStrategy's, with rank 0's ``seed_everything`` seed for every rank (read, a broadcast, when
        ``fabric.setup_dataloaders`` runs on every rank)."""
        return {**super().distributed_sampler_kwargs, "seed": sampler_seed(self)}

    # ------------------------------------------------------------------------------------------ lifecycle
    @override
    def setup_environment(self) -> None:
        check_strategy_world_size(self, api="Fabric")
        super().setup_environment()
        if self.sync_every > 1 and self.combine == "adasum" and self.outer_optimizer is None:
            rank_zero_warn(local_sgd_without_outer_message(self.strategy_name, self.sync_every))
        if self.overlap_sync and self.world_size > 1:  # a collective: every rank builds it here
            timeout = _compat.process_group_timeout(self)
            self._overlap_group = dist.new_group(backend=dist.get_backend(), timeout=timeout)

    @override
    def setup_module(self, module: Module) -> Module:
        """Give every rank the first rank's parameters and buffers; no ``DistributedDataParallel`` wrapper."""
        prepare_unwrapped_module(self, module)
        return module

    @override
    def teardown(self) -> None:
        release_workspace()  # the reduction's buffers, kept between steps
        close_windows(self._periodic)
        if self._overlap_group is not None:
            dist.destroy_process_group(self._overlap_group)
            self._overlap_group = None
        super().teardown()

    # ------------------------------------------------------------------------------------------ step
    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Fabric's local step, then the Adasum of the parameter deltas over all ranks (see the class)."""
        local_step = functools.partial(super().optimizer_step, optimizer, **kwargs)
        return self._periodic_sync(optimizer).step(local_step)

    def _periodic_sync(self, optimizer: Optimizer) -> PeriodicSync:
        built = self._periodic.get(id(optimizer))
        if built is not None:
            return built
        restored = self._restored_periodic
        state = restored[len(self._periodic)] if len(restored) > len(self._periodic) else None
        timeout = _compat.process_group_timeout(self)
        built = periodic_sync(self, optimizer, state, timeout, self._overlap_group)
        self._periodic[id(optimizer)] = built
        return built

    def end_windows(self) -> None:
        """Sync every optimizer's parameters now (every rank calls it; with ``overlap_sync`` the exchange in
        flight first): the ranks then hold θ_sync."""
        for periodic in self._periodic.values():
            periodic.sync()

    # ------------------------------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: Filter | None = None,
    ) -> None:
        """End the windows (the file holds the synced parameters, their state), then rank 0 saves in place."""
        self.end_windows()
        state = {**state, ckpt.SAVED_WORLD_SIZE: self.world_size}
        if self._periodic:
            state = {**state, ckpt.PERIODIC_SYNC_STATES: ckpt.window_states(list(self._periodic.values()))}
        converted, _ = ckpt.convert_state(state, self.get_module_state_dict, self.get_optimizer_state, filter)
        if self.is_global_zero:
            in_place = type(self.checkpoint_io) is TorchCheckpointIO
            ckpt.save_through(self.checkpoint_io, converted, path, storage_options, in_place)

    @override
    def load_checkpoint(
        self, path: Any, state: Any = None, strict: bool = True, **kwargs: Any
    ) -> dict[str, Any]:
        """Fabric's load, then rank 0's resume line; the windows restore their positions and outer states at
        their first steps."""
        remainder = super().load_checkpoint(path, state, strict=strict, **kwargs)
        if not isinstance(remainder, dict):
            return remainder
        saved = remainder.pop(ckpt.SAVED_WORLD_SIZE, None)
        step = state.get("step", "?") if isinstance(state, dict) else "?"
        rank_zero_info(ckpt.resume_line(type(self).__name__, path, step, saved, self.world_size))
        if ckpt.PERIODIC_SYNC_STATES in remainder:
            self._restored_periodic = remainder.pop(ckpt.PERIODIC_SYNC_STATES)
            close_windows(self._periodic)
        return remainder

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register(strategy_registry, cls)


class _LocalGradientsSyncControl(_compat.BackwardSyncControl):
    """``fabric.no_backward_sync`` under Adasum: gradients are never synchronised in backward, so nothing to
    skip; accumulation works by stepping every k-th batch."""

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        return nullcontext()
