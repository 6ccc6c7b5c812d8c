"""Learning-rate scaling by a factor, shared by the strategies (``lr_scaling``) and the simulator.

Averaging over N workers shrinks the update, so pytorch-lightning 1.x's Horovod strategy multiplied every
learning rate by N; Adasum needs no such factor (Maleki et al., MLSys 2021).
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Callable, Iterable
from typing import Any

from torch.optim import Optimizer

__all__ = ["LR_KEYS", "check_lr_scaling", "lr_factor", "scale_learning_rates", "scaled_learning_rate_message"]

#: Param-group keys that hold a learning rate (the optimizer's, and the schedulers' copies).
LR_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")


def check_lr_scaling(value: str | float) -> str | float:
    """``"auto"``, ``"none"`` or the factor as a float; ValueError for anything else."""
    if value in ("auto", "none"):
        return value
    with contextlib.suppress(ValueError):
        value = float(value) if isinstance(value, str) else value
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ValueError(f"lr_scaling must be 'auto', 'none' or a positive number, got {value!r}")
    return float(value)


def scale_learning_rates(optimizers: Iterable[Optimizer], schedulers: Iterable[Any], factor: float) -> None:
    """Multiply the param groups' :data:`LR_KEYS` and the schedulers' ``base_lrs`` by ``factor``, once."""
    if factor == 1.0:
        return
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for key in LR_KEYS:
                if isinstance(group.get(key), numbers.Real):
                    group[key] = group[key] * factor
    for scheduler in schedulers:
        if hasattr(scheduler, "base_lrs"):
            scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]


def lr_factor(lr_scaling: str | float, auto: Callable[[], float]) -> float:
    """The factor of a checked ``lr_scaling``: 1 for ``"none"``, ``auto()`` for ``"auto"``, else the value."""
    if lr_scaling == "none":
        return 1.0
    if lr_scaling == "auto":
        return auto()
    return float(lr_scaling)


def scaled_learning_rate_message(strategy_name: str, factor: float) -> str:
    """The warning when a strategy multiplied the learning rates the module (or ``Tuner.lr_find``) set."""
    return (
        f"{strategy_name} multiplied every learning rate by {factor:g} (lr_scaling): the rates your "
        f"configure_optimizers returns (a Tuner.lr_find suggestion included) train {factor:g}× larger. Pass "
        f"lr_scaling='none' to train with them as they are."
    )
