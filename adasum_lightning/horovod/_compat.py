"""The private Horovod 0.28.1 APIs the strategies use (checked by ``tests/test_compat.py``); imports neither
Horovod nor Lightning."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch.optim import Optimizer

from adasum_lightning._private_apis import PrivateApi

__all__ = [
    "PRIVATE_APIS",
    "is_horovod_adasum_optimizer",
    "horovod_completes_window",
    "horovod_requires_update",
    "release_horovod_hooks",
    "route_horovod_methods_to",
]

PRIVATE_APIS: tuple[PrivateApi, ...] = (
    PrivateApi(
        "horovod.torch.optimizer",
        "_DistributedAdasumOptimizer",
        "Horovod 0.28.1",
        attributes=(
            "self._starting_models",
            "self._allreduce_delay",
            "self._requires_update",
            "self._grad_accs",
        ),
    ),
    # Horovod builds one class per DistributedOptimizer call, whose methods call super(self.__class__, self).
    PrivateApi(
        "horovod.torch.optimizer",
        "DistributedOptimizer",
        "Horovod 0.28.1",
        attributes=(
            "dict(_DistributedOptimizer.__dict__)",
            "dict(_DistributedAdasumOptimizer.__dict__)",
            "super(self.__class__, self).zero_grad()",
        ),
    ),
)


def is_horovod_adasum_optimizer(optimizer: Optimizer) -> bool:
    """True for Horovod's ``_DistributedAdasumOptimizer`` (a class Horovod builds at run time)."""
    return "_starting_models" in vars(optimizer)


def horovod_requires_update(optimizer: Optimizer) -> list[Any]:
    """The parameters Horovod's Adasum optimizer reduces (those with ``requires_grad``)."""
    return list(optimizer._requires_update)


def horovod_completes_window(optimizer: Optimizer, param: Any) -> bool:
    """True when this backward pass ends ``param``'s accumulation window (the hook then steps at once)."""
    return optimizer._allreduce_delay.get(param) == 1


def release_horovod_hooks(optimizer: Optimizer) -> None:
    """Drop the references that keep Horovod's backward hooks alive, so that a later ``fit`` wraps afresh."""
    grad_accs = getattr(optimizer, "_grad_accs", None)
    if isinstance(grad_accs, list):
        grad_accs.clear()


#: Horovod's optimizer methods that Lightning's and Fabric's wrappers reach through its class.
_HOROVOD_METHODS = ("zero_grad", "synchronize", "skip_synchronize", "set_backward_passes_per_step")


def route_horovod_methods_to(optimizer: Any) -> None:
    """Rebind Horovod's optimizer methods to ``optimizer`` itself (its class is its own).

    Lightning's and Fabric's wrappers subclass the optimizer's class, so Horovod's
    ``super(self.__class__, self).zero_grad()`` would recurse without end through them.
    """
    cls = type(optimizer)
    for name in _HOROVOD_METHODS:
        if name in vars(cls):
            setattr(cls, name, _bound_to_instance(getattr(optimizer, name)))


def _bound_to_instance(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(_self: Any, *args: Any, **kwargs: Any) -> Any:
        return method(*args, **kwargs)

    return call
