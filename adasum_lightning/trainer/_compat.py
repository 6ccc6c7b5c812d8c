"""Every private Lightning and torch API the Trainer strategies use, in one place (Horovod's:
:mod:`adasum_lightning.horovod._compat`).

Each entry names where it was read; :func:`adasum_lightning._private_apis.missing` checks that the installed
versions still have them (``tests/test_compat.py``). Read from pytorch-lightning 2.4.0 and 2.6.6 (lightning
2.6.6 the same), torch 2.14.1.
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
    "layer_sync",
    "process_group_timeout",
    "has_sigterm_agreement",
    "run_closure",
    "mark_step_for_schedulers",
]


PRIVATE_APIS: tuple[PrivateApi, ...] = (
    PrivateApi("pytorch_lightning.core.optimizer", "_configure_optimizers", "pytorch-lightning 2.4.0, 2.6.6"),
    PrivateApi(
        "pytorch_lightning.core.optimizer",
        "_configure_schedulers_automatic_opt",
        "pytorch-lightning 2.4.0, 2.6.6",
    ),
    # Lightning's broadcast of a module's parameters and buffers from rank 0 (torch's _sync_module_states).
    PrivateApi(
        "pytorch_lightning.overrides.distributed", "_sync_module_states", "pytorch-lightning 2.4.0, 2.6.6"
    ),
    PrivateApi(
        "pytorch_lightning.strategies.strategy",
        "Strategy",
        "pytorch-lightning 2.4.0, 2.6.6",
        attributes=("self._launcher",),
    ),
    # fsdp_adasum: the steps through the FSDP2 root module's forward (as DDPStrategy's through its wrapper),
    # and the mesh a LightningModule's configure_model() reads (as ModelParallelStrategy sets it).
    PrivateApi(
        "pytorch_lightning.strategies.strategy",
        "_ForwardRedirection",
        "pytorch-lightning 2.6.6",
        attributes=("self._forward_redirection",),
    ),
    PrivateApi(
        "pytorch_lightning.core.module",
        "LightningModule",
        "pytorch-lightning 2.6.6",
        attributes=("self._device_mesh",),
    ),
    PrivateApi(
        "pytorch_lightning.strategies.parallel",
        "ParallelStrategy",
        "pytorch-lightning 2.4.0, 2.6.6",
        attributes=("self._parallel_devices", "self._layer_sync"),
    ),
    PrivateApi(
        "pytorch_lightning.strategies.ddp",
        "DDPStrategy",
        "pytorch-lightning 2.4.0, 2.6.6",
        attributes=("self._timeout",),
    ),
    PrivateApi(
        "pytorch_lightning.core.optimizer",
        "LightningOptimizer",
        "pytorch-lightning 2.4.0, 2.6.6",
        ("self._optimizer",),
    ),
    # The closure and its hooks without the step: ddp_adasum(overlap_backward=True) steps during backward.
    PrivateApi(
        "pytorch_lightning.plugins.precision.precision",
        "Precision",
        "pytorch-lightning 2.4.0, 2.6.6",
        attributes=("def _wrap_closure", "self._after_closure(model, optimizer)"),
    ),
    # Rank 0's SIGTERM broadcast at every training batch: all ranks stop at the same step.
    PrivateApi(
        "pytorch_lightning.loops.training_epoch_loop",
        "_TrainingEpochLoop",
        "pytorch-lightning 2.6.6 (absent in 2.4.0)",
        attributes=("_broadcast_sigterm_tensor",),
        optional=True,
    ),
    PrivateApi(
        "torch.optim.lr_scheduler",
        "LRScheduler",
        "torch 2.14.1",
        attributes=("_wrapped_by_lr_sched", "_opt_called"),
    ),
)


# ---------------------------------------------------------------------------------------------- Lightning
#: ``LightningModule.configure_optimizers()``'s output → (optimizers, schedulers, monitor).
configure_optimizers: Callable[[Any], tuple[list, list, Any]] = _configure_optimizers
#: Scheduler specs → Lightning's ``LRSchedulerConfig`` list (automatic optimisation).
configure_schedulers: Callable[[list, Any], list] = _configure_schedulers_automatic_opt
#: Broadcast a module's parameters and buffers from rank 0 over the default group (any dtype, any layout).
sync_module_states: Callable[[Any], None] = _sync_module_states


def layer_sync(strategy: Any) -> Any:
    """The layer synchronisation the Trainer gave the strategy (``sync_batchnorm=True``), else None."""
    return strategy._layer_sync


def process_group_timeout(strategy: Any) -> Any:
    """The ``timeout`` a DDP strategy gives its process group (``DDPStrategy(timeout=...)``)."""
    return strategy._timeout


def run_closure(precision_plugin: Any, model: Any, optimizer: Optimizer, closure: Callable[[], Any]) -> Any:
    """The closure (forward, backward), ``on_before_optimizer_step`` and clipping, without the step.

    Returns:
        The closure's result.
    """
    return precision_plugin._wrap_closure(model, optimizer, closure)


def has_sigterm_agreement() -> bool:
    """True when the installed Lightning makes every rank stop at the same step after rank 0's SIGTERM."""
    from pytorch_lightning.loops.training_epoch_loop import _TrainingEpochLoop

    return hasattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor")


# ---------------------------------------------------------------------------------------------- torch
def mark_step_for_schedulers(optimizer: Optimizer) -> None:
    """Let torch's LR schedulers see ``step()`` calls of an optimizer wrapped after they were created.

    As ``LRScheduler`` does for its own optimizer (a marked ``step``, ``_opt_called``), so that they neither
    warn nor lose track of the step order.
    """
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return

    @functools.wraps(step)
    def step_and_mark(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True
        return step(*args, **kwargs)

    step_and_mark._wrapped_by_lr_sched = True
    optimizer.step = step_and_mark
