"""Every private Lightning and torch API the Trainer strategies use, checked by
:func:`adasum_lightning._private_apis.missing` (Horovod's: :mod:`adasum_lightning.horovod._compat`).

Read from pytorch-lightning 2.4.0 and 2.6.6 (lightning 2.6.6 the same), torch 2.14.1.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from pytorch_lightning.core.optimizer import _configure_optimizers, _configure_schedulers_automatic_opt
from pytorch_lightning.overrides.distributed import _sync_module_states
from torch.optim import Optimizer

from adasum_lightning._private_apis import PrivateApi

__all__ = [
    "PRIVATE_APIS",
    "configure_optimizers",
    "configure_schedulers",
    "sync_module_states",
    "has_sigterm_agreement",
    "hold_sigterm_agreement",
    "mark_step_for_schedulers",
]


_BOTH, _NEW = "pytorch-lightning 2.4.0, 2.6.6", "pytorch-lightning 2.6.6"
_STRATEGY = "pytorch_lightning.strategies.strategy"
PRIVATE_APIS: tuple[PrivateApi, ...] = (
    # benchmarks/simulate.py: a LightningModule's optimizers and schedulers, as the Trainer builds them.
    PrivateApi("pytorch_lightning.core.optimizer", "_configure_optimizers", _BOTH),
    PrivateApi("pytorch_lightning.core.optimizer", "_configure_schedulers_automatic_opt", _BOTH),
    # Lightning's broadcast of a module's parameters and buffers from rank 0 (torch's _sync_module_states).
    PrivateApi("pytorch_lightning.overrides.distributed", "_sync_module_states", _BOTH),
    PrivateApi(_STRATEGY, "Strategy", _BOTH, ("self._launcher",)),
    # fsdp_adasum: the steps through the FSDP2 root's forward, and the mesh configure_model() reads.
    PrivateApi(_STRATEGY, "_ForwardRedirection", _NEW, ("self._forward_redirection",)),
    PrivateApi("pytorch_lightning.core.module", "LightningModule", _NEW, ("self._device_mesh",)),
    PrivateApi(
        "pytorch_lightning.strategies.parallel",
        "ParallelStrategy",
        _BOTH,
        ("self._parallel_devices", "self._layer_sync"),
    ),
    PrivateApi("pytorch_lightning.strategies.ddp", "DDPStrategy", _BOTH, ("self._timeout",)),
    # The closure and its hooks without the step: ddp_adasum(overlap_backward=True) steps during backward.
    PrivateApi(
        "pytorch_lightning.plugins.precision.precision",
        "Precision",
        _BOTH,
        ("def _wrap_closure", "self._after_closure(model, optimizer)"),
    ),
    # Rank 0's SIGTERM broadcast at every training batch: all ranks stop at the same step (local SGD holds
    # it to the batches where the ranks meet: hold_sigterm_agreement).
    PrivateApi(
        "pytorch_lightning.loops.training_epoch_loop",
        "_TrainingEpochLoop",
        "pytorch-lightning 2.6.6 (absent in 2.4.0)",
        ("_broadcast_sigterm_tensor",),
        optional=True,
    ),
    PrivateApi(
        "torch.optim.lr_scheduler", "LRScheduler", "torch 2.14.1", ("_wrapped_by_lr_sched", "_opt_called")
    ),
)


#: ``LightningModule.configure_optimizers()``'s output → (optimizers, schedulers, monitor).
configure_optimizers: Callable[[Any], tuple[list, list, Any]] = _configure_optimizers
#: Scheduler specs → Lightning's ``LRSchedulerConfig`` list (automatic optimisation).
configure_schedulers: Callable[[list, Any], list] = _configure_schedulers_automatic_opt
#: Broadcast a module's parameters and buffers from rank 0 over the default group (any dtype, any layout).
sync_module_states: Callable[[Any], None] = _sync_module_states


def has_sigterm_agreement() -> bool:
    """True when the installed Lightning makes every rank stop at the same step after rank 0's SIGTERM."""
    from pytorch_lightning.loops.training_epoch_loop import _TrainingEpochLoop

    return hasattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor")


def hold_sigterm_agreement(
    trainer: Any, batch_start: Callable[[Callable[[], None]], None]
) -> Callable[[], None]:
    """Call ``batch_start(agree)`` at the start of each training batch instead of Lightning's SIGTERM
    broadcast (``agree``: that broadcast, which raises ``SIGTERMException`` on every rank after rank 0's
    SIGTERM); returns the function that restores the broadcast at every batch."""
    loop = trainer.fit_loop.epoch_loop
    loop._broadcast_sigterm_tensor = functools.partial(batch_start, loop._broadcast_sigterm_tensor)
    return functools.partial(loop.__dict__.pop, "_broadcast_sigterm_tensor", None)


def mark_step_for_schedulers(optimizer: Optimizer) -> None:
    """Mark ``step()`` of an optimizer wrapped after its LR schedulers were created, as ``LRScheduler`` does,
    so that they neither warn nor lose track of the step order."""
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return

    @functools.wraps(step)
    def step_and_mark(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True
        return step(*args, **kwargs)

    step_and_mark._wrapped_by_lr_sched = True
    optimizer.step = step_and_mark
