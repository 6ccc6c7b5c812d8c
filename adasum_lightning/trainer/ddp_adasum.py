"""``ddp_adasum``: Adasum of parameter deltas on ``torch.distributed``, launched like a Lightning DDP job."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.plugins.precision import MixedPrecision, Precision
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.model_helpers import is_overridden
from pytorch_lightning.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

import adasum_lightning.checkpoint as ckpt
from adasum_lightning.allreduce import release_workspace
from adasum_lightning.launch_environment import check_strategy_world_size
from adasum_lightning.local_sgd import (
    PeriodicSync,
    check_outer_optimizer_form,
    check_sync_every,
    close_windows,
    local_sgd_without_outer_message,
    periodic_sync,
)
from adasum_lightning.step import (
    PER_PARAMETER_OPTIMIZERS,
    BackwardAdasumStep,
    adasum_step,
    check_overlap_backward,
    check_wire_compression,
    optimizer_parameters,
    overlap_fallback_reason,
)

from . import _compat
from ._base import UpdateReducingDDPStrategy

__all__ = ["DDPAdasumStrategy"]


class DDPAdasumStrategy(UpdateReducingDDPStrategy):
    """Data-parallel training with Adasum of parameter deltas on ``torch.distributed``.

    Every rank runs Lightning's local step, then sets ``θ = θ_before + Adasum(deltas)``
    (:func:`adasum_lightning.step.adasum_step`); each rank keeps its own optimizer state.

    Args:
        overlap_backward: step and reduce bucket by bucket during backward where the result is the same
            (:class:`~adasum_lightning.step.BackwardAdasumStep`); otherwise the whole step, logged once.
        bucket_cap_mb: ``overlap_backward``'s bucket size in MiB (as DDP's).
        sync_every: local optimizer steps between syncs (local SGD, :mod:`adasum_lightning.local_sgd`). A
            window ends early where Lightning validates, saves a checkpoint or ends ``fit``. The ranks meet
            only where windows end, so Lightning's SIGTERM agreement runs there: a SIGTERM stops every rank
            at the end of the window in progress (with ``overlap_sync``, at the end of the next one).
        combine: ``"adasum"`` or ``"mean"``: how the ranks' pseudo-gradients are combined.
        outer_optimizer: None, or a callable that builds the outer optimizer from an optimizer's parameters,
            e.g. ``functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)`` (DiLoCo).
        compression: None, ``"bf16"`` or ``"fp16"``: the dtype of every piece the combination sends.
        overlap_sync: run each window's exchange behind the next window's steps, applied one window late.
        **kwargs: :class:`~adasum_lightning.trainer._base.UpdateReducingDDPStrategy`'s (``DDPStrategy``'s,
            ``lr_scaling``, ``uneven_inputs``).

    Raises:
        AdasumConfigurationError: an invalid local-SGD setting or ``compression`` (ValueError: overlap's).
    """

    strategy_name = "ddp_adasum"

    def __init__(
        self,
        overlap_backward: bool = False,
        bucket_cap_mb: float = 25,
        sync_every: int = 1,
        combine: str = "adasum",
        outer_optimizer: Callable[[list[torch.Tensor]], Optimizer] | None = None,
        compression: str | None = None,
        overlap_sync: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        name = self.strategy_name
        check_overlap_backward(overlap_backward, bucket_cap_mb, name)
        check_sync_every(
            sync_every, combine, name, overlap_backward, outer_optimizer is not None, overlap_sync
        )
        check_outer_optimizer_form(name, outer_optimizer, builder=True)
        self.overlap_backward = overlap_backward
        self.bucket_cap_mb = bucket_cap_mb
        self.sync_every = int(sync_every)
        self.combine = combine
        self.outer_optimizer = outer_optimizer
        self.compression = compression
        self.wire_dtype = check_wire_compression(compression, name)
        self.overlap_sync = overlap_sync
        self._periodic: dict[int, PeriodicSync] = {}  # per optimizer (by id): its local-SGD windows
        self._restored_periodic: list[dict[str, Any]] | None = None
        self._overlap_group: dist.ProcessGroup | None = None
        self._backward_steps: dict[int, BackwardAdasumStep | None] = {}  # None: the whole step
        self._window_ended = True  # the ranks met at the last optimizer step (or fit starts)
        self._restore_sigterm_agreement: Callable[[], None] | None = None
        # overlap_sync: rank 0's SIGTERM flag, broadcast after each window end and read after the next one
        self._sigterm_group: dist.ProcessGroup | None = None
        self._sigterm_flag: tuple[dist.Work, torch.Tensor] | None = None

    @property
    def _every_step(self) -> bool:
        return self.sync_every == 1 and self.combine == "adasum" and self.outer_optimizer is None

    @override
    def setup_environment(self) -> None:
        check_strategy_world_size(self, api="Trainer")
        super().setup_environment()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if self.sync_every > 1 and self.combine == "adasum" and self.outer_optimizer is None:
            rank_zero_warn(local_sgd_without_outer_message(self.strategy_name, self.sync_every))
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self.sync_every > 1 and fitting and not any(isinstance(c, _EndWindows) for c in trainer.callbacks):
            trainer.callbacks.insert(0, _EndWindows(self))  # first: before the others' end-of-fit hooks
        if (self.overlap_backward or self.overlap_sync) and self.world_size > 1 and fitting:
            # the worker thread's own process group (a collective: every rank builds it here)
            self._overlap_group = dist.new_group(backend=dist.get_backend(), timeout=self._timeout)
        if self.overlap_sync and self.world_size > 1 and fitting and _compat.has_sigterm_agreement():
            self._sigterm_group = dist.new_group(backend="gloo", timeout=self._timeout)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        if not self._every_step and self.world_size > 1 and _compat.has_sigterm_agreement():
            self._window_ended = True
            self._restore_sigterm_agreement = _compat.hold_sigterm_agreement(trainer, self._batch_start)

    def _batch_start(self, agree_on_sigterm: Callable[[], None]) -> None:
        """Lightning's SIGTERM agreement at the first batch after a window end, where the ranks have just met:
        rank 0's flag (a SIGTERM received) is broadcast, and on its SIGTERM every rank runs the handler and
        the agreement, also where its own SIGTERM (the launcher forwards it) has not arrived yet. With
        ``overlap_sync`` the ranks do not meet there: the flag is sent without waiting, read after the next
        window end."""
        if not self._window_ended:
            return
        self._window_ended = False
        device = self.root_device if self._sigterm_group is None else torch.device("cpu")  # gloo's group
        flag = torch.tensor([int(self._pending_sigterm is not None)], device=device)
        sent = (dist.broadcast(flag, 0, group=self._sigterm_group, async_op=True), flag)
        if self._sigterm_group is None:
            received: tuple[dist.Work, torch.Tensor] | None = sent
        else:
            received, self._sigterm_flag = self._sigterm_flag, sent
        if received is not None:
            received[0].wait()
            if received[1].item():
                self._deliver_pending_sigterm(agreed=True)
                agree_on_sigterm()

    @override
    def _describe_reduction(self) -> str:
        overlap = ", bucket by bucket during backward" if self.overlap_backward else ""
        wire = f", sent as {self.compression}" if self.compression else ""
        if not self._every_step:
            outer = "an outer optimizer" if self.outer_optimizer is not None else "no outer optimizer"
            behind = ", exchanged behind the next window's steps" if self.overlap_sync else ""
            return (
                f"local SGD over {self.process_group_backend}: every {self.sync_every} steps the "
                f"{self.combine} of the pseudo-gradients{wire}{behind}, {outer}"
            )
        return f"Adasum of parameter deltas over {self.process_group_backend}{wire}{overlap}"

    @override
    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        """Lightning's local step, then the Adasum of the parameter deltas over all ranks (see the class)."""
        overlap = self.overlap_backward and self._overlap_group is not None
        backward_step = self._backward_step(optimizer) if overlap else None
        if backward_step is not None and not kwargs:
            # the closure's backward steps and reduces the buckets (the optimizer's own step is not called)
            backward_step.armed = True
            try:
                model = model or self.lightning_module
                output = self.precision_plugin._wrap_closure(model, optimizer, closure)  # no step
            finally:
                backward_step.armed = False
            backward_step.finish()
        else:
            local_step = functools.partial(super().optimizer_step, optimizer, closure, model, **kwargs)
            timeout = self._timeout
            if self._every_step:
                params = optimizer_parameters(optimizer)
                output = adasum_step(params, local_step, None, timeout, self.wire_dtype)
            else:
                periodic = self._periodic_sync(optimizer, timeout)
                output = periodic.step(local_step)
                self._window_ended = self._window_ended or not periodic.steps
                if periodic.steps or self._restore_sigterm_agreement is not None:
                    return output  # a SIGTERM waits for the batch where the ranks agree on it
        self._deliver_pending_sigterm()
        return output

    def _periodic_sync(self, optimizer: Optimizer, timeout: Any) -> PeriodicSync:
        """``optimizer``'s windows, built at its first step (after the broadcast and a checkpoint restore)."""
        if id(optimizer) not in self._periodic:
            index = list(self.optimizers).index(optimizer)
            restored = self._restored_periodic or []
            state = restored[index] if index < len(restored) else None
            built = periodic_sync(self, optimizer, state, timeout, self._overlap_group)
            self._periodic[id(optimizer)] = built
        return self._periodic[id(optimizer)]

    def end_windows(self) -> None:
        """Sync every optimizer's parameters now (a collective): Lightning evaluates or saves them next."""
        for periodic in self._periodic.values():
            periodic.sync()

    def _backward_step(self, optimizer: Optimizer) -> BackwardAdasumStep | None:
        """``optimizer``'s bucketed step (rebuilt when its parameters change), or None: the whole step."""
        key = id(optimizer)
        built = self._backward_steps.get(key)
        if key in self._backward_steps and (built is None or built.is_current()):
            return built
        if built is not None:
            built.close()
        reason = self._overlap_fallback_reason(optimizer)
        if reason is not None:
            rank_zero_info(
                f"{type(self).__name__}: overlap_backward: {type(optimizer).__name__} takes the whole step "
                f"after backward, because {reason} (the same parameters; the reduction does not overlap "
                "backward)"
            )
            self._backward_steps[key] = None
            return None
        assert self._overlap_group is not None
        bucket_bytes = int(self.bucket_cap_mb * 2**20)
        timeout = self._timeout
        step = BackwardAdasumStep(optimizer, self._overlap_group, bucket_bytes, timeout, self.wire_dtype)
        step.armed = False  # only the backward inside optimizer_step steps (not an accumulation window's)
        self._backward_steps[key] = step
        return step

    def _overlap_fallback_reason(self, optimizer: Optimizer) -> str | None:
        module = self.lightning_module
        assert module is not None
        trainer = module.trainer
        clipping = None
        if trainer.gradient_clip_val:
            clipping = f"gradient_clip_val={trainer.gradient_clip_val}"
        elif is_overridden("configure_gradient_clipping", module, pl.LightningModule):
            clipping = f"{type(module).__name__}.configure_gradient_clipping"
        plugin = self.precision_plugin
        own_step = type(plugin).optimizer_step not in (
            Precision.optimizer_step,
            MixedPrecision.optimizer_step,
        )
        # hooks that see or change the gradients between backward and the step
        hooks = [
            f"{type(c).__name__}.{hook}"
            for c in trainer.callbacks
            for hook in ("on_after_backward", "on_before_optimizer_step")
            if is_overridden(hook, c, Callback)
        ]
        hooks += [
            f"{type(module).__name__}.{hook}"
            for hook in ("backward", "on_after_backward", "on_before_optimizer_step")
            if is_overridden(hook, module, pl.LightningModule)
        ]
        return overlap_fallback_reason(
            automatic_optimization=module.automatic_optimization,
            optimizer=type(optimizer).__name__,
            per_parameter=type(optimizer) in PER_PARAMETER_OPTIMIZERS,
            gradient_clipping=clipping,
            gradient_scaler=getattr(plugin, "scaler", None) is not None,
            precision_plugin=type(plugin).__name__ if own_step else None,
            before_step_hooks=hooks,
        )

    @override
    def on_validation_start(self) -> None:
        self.end_windows()
        super().on_validation_start()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.end_windows()  # a checkpoint holds the synced parameters, the same on every rank
        return super().lightning_module_state_dict()

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """The checkpoint also records each optimizer's window state."""
        if self._periodic and "optimizer_states" in checkpoint:
            windows = [self._periodic.get(id(o)) for o in self.optimizers]
            checkpoint = {**checkpoint, ckpt.PERIODIC_SYNC_STATES: ckpt.window_states(windows)}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        self._restored_periodic = checkpoint.get(ckpt.PERIODIC_SYNC_STATES)
        close_windows(self._periodic)
        super().load_optimizer_state_dict(checkpoint)

    @override
    def teardown(self) -> None:
        release_workspace()  # the reduction's buffers, kept between steps
        for built in filter(None, self._backward_steps.values()):
            built.close()
        self._backward_steps.clear()
        close_windows(self._periodic)  # after a fit, on_train_end has synced them
        if self._restore_sigterm_agreement is not None:
            self._restore_sigterm_agreement()
            self._restore_sigterm_agreement = None
        if self._overlap_group is not None:
            dist.destroy_process_group(self._overlap_group)
            self._overlap_group = None
        flag, self._sigterm_flag = self._sigterm_flag, None
        if self._sigterm_group is not None and (flag is None or flag[0].is_completed()):
            dist.destroy_process_group(self._sigterm_group)  # else left to the process's end: a rank is gone
        self._sigterm_group = None
        super().teardown()


class _EndWindows(Callback):
    """Ends the strategy's windows before the other callbacks see the model at the end of ``fit``."""

    def __init__(self, strategy: DDPAdasumStrategy) -> None:
        self.strategy = strategy

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning's stop conditions, the same on every rank (the epoch counts as done here)
        max_steps, max_epochs = trainer.max_steps, trainer.max_epochs
        if (
            trainer.should_stop
            or 0 <= max_steps <= trainer.global_step
            or (max_epochs is not None and 0 <= max_epochs <= trainer.current_epoch + 1)
        ):
            self.strategy.end_windows()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.strategy.end_windows()
