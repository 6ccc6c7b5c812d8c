"""``Fabric(strategy="ddp_adasum")``: Adasum of parameter deltas on ``torch.distributed``, in Fabric."""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from lightning_fabric.plugins import TorchCheckpointIO
from lightning_fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

import adasum_lightning.checkpoint as ckpt
from adasum_lightning import local_sgd
from adasum_lightning.checkpoint import Filter
from adasum_lightning.replicas import prepare_unwrapped_module
from adasum_lightning.step import adasum_step, optimizer_parameters

from . import _compat
from ._base import UpdateReducingDDPStrategy

__all__ = ["DDPAdasumStrategy"]


class DDPAdasumStrategy(UpdateReducingDDPStrategy):
    """Fabric's DDP strategy with Adasum of parameter deltas instead of gradient averaging.

    ``optimizer.step()`` runs Fabric's local step, then the Adasum of the deltas, as the Trainer's
    ``ddp_adasum``. The module is not wrapped: gradients stay local.

    Args:
        sync_every, combine, outer_optimizer, overlap_sync: local SGD, as for the Trainer's ``ddp_adasum``; a
            window ends early at ``fabric.save``. Call ``fabric.strategy.end_windows()`` on every rank before
            evaluating mid-window and at the end of training.
        **kwargs: :class:`~adasum_lightning.fabric._base.UpdateReducingDDPStrategy`'s (``DDPStrategy``'s,
            ``compression``).

    Raises:
        AdasumConfigurationError: an invalid local-SGD setting; on every rank, a bad launch or module.
    """

    strategy_name = "ddp_adasum"

    def __init__(
        self,
        sync_every: int = 1,
        combine: str = "adasum",
        outer_optimizer: Callable[[list[torch.Tensor]], Optimizer] | None = None,
        overlap_sync: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._backward_sync_control = _LocalGradientsSyncControl()
        local_sgd.check_sync_every(sync_every, combine, self.strategy_name, overlap_sync=overlap_sync)
        local_sgd.check_outer_optimizer_form(self.strategy_name, outer_optimizer, builder=True)
        self.sync_every = int(sync_every)
        self.combine = combine
        self.outer_optimizer = outer_optimizer
        self.overlap_sync = overlap_sync
        self._overlap_group: dist.ProcessGroup | None = None  # overlap_sync's worker thread's
        # per optimizer (by id), in the order of first steps
        self._periodic: dict[int, local_sgd.PeriodicSync] = {}
        self._restored_periodic: list[dict[str, Any]] = []

    @property
    def _every_step(self) -> bool:
        return self.sync_every == 1 and self.combine == "adasum" and self.outer_optimizer is None

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.sync_every > 1 and self.combine == "adasum" and self.outer_optimizer is None:
            rank_zero_warn(local_sgd.local_sgd_without_outer_message(self.strategy_name, self.sync_every))
        if self.overlap_sync and self.world_size > 1:  # a collective: every rank builds it here
            timeout = self._timeout
            self._overlap_group = dist.new_group(backend=dist.get_backend(), timeout=timeout)

    @override
    def setup_module(self, module: Module) -> Module:
        """Give every rank the first rank's parameters and buffers; no ``DistributedDataParallel`` wrapper."""
        prepare_unwrapped_module(self, module)
        return module

    @override
    def teardown(self) -> None:
        local_sgd.close_windows(self._periodic)
        if self._overlap_group is not None:
            dist.destroy_process_group(self._overlap_group)
            self._overlap_group = None
        super().teardown()

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Fabric's local step, then the Adasum of the parameter deltas over all ranks (see the class)."""
        local_step = functools.partial(super().optimizer_step, optimizer, **kwargs)
        timeout = self._timeout
        if self._every_step:
            return adasum_step(optimizer_parameters(optimizer), local_step, None, timeout, self.wire_dtype)
        if id(optimizer) not in self._periodic:
            restored, count = self._restored_periodic, len(self._periodic)
            state = restored[count] if len(restored) > count else None
            built = local_sgd.periodic_sync(self, optimizer, state, timeout, self._overlap_group)
            self._periodic[id(optimizer)] = built
        return self._periodic[id(optimizer)].step(local_step)

    def end_windows(self) -> None:
        """Sync every optimizer's parameters now (every rank calls it): the ranks then hold θ_sync."""
        for periodic in self._periodic.values():
            periodic.sync()

    @override
    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Any = None, filter: Filter | None = None
    ) -> None:
        """End the windows (the file holds the synced parameters), then rank 0 saves."""
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
            local_sgd.close_windows(self._periodic)
        return remainder


class _LocalGradientsSyncControl(_compat.BackwardSyncControl):
    """``fabric.no_backward_sync`` under Adasum: gradients are never synchronised in backward."""

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        return nullcontext()
