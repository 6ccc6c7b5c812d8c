"""The private APIs the Fabric strategies use, checked by :func:`adasum_lightning._private_apis.missing`.

Read from lightning-fabric 2.4.0 and 2.6.6 (lightning 2.6.6 the same) and Horovod 0.28.1.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from lightning_fabric.strategies.strategy import _BackwardSyncControl

from adasum_lightning._private_apis import PrivateApi

__all__ = ["PRIVATE_APIS", "BackwardSyncControl", "process_group_timeout", "route_horovod_methods_to"]

PRIVATE_APIS: tuple[PrivateApi, ...] = (
    # The interface behind fabric.no_backward_sync; a strategy sets _backward_sync_control to one.
    PrivateApi(
        "lightning_fabric.strategies.strategy",
        "_BackwardSyncControl",
        "lightning-fabric 2.4.0, 2.6.6",
    ),
    # A strategy that starts no processes sets _launcher to None in _configure_launcher (the Horovod ones).
    PrivateApi(
        "lightning_fabric.strategies.strategy",
        "Strategy",
        "lightning-fabric 2.4.0, 2.6.6",
        attributes=("self._backward_sync_control", "self._launcher", "def _configure_launcher"),
    ),
    # Fabric's optimizer wrapper subclasses the wrapped optimizer's class (route_horovod_methods_to).
    PrivateApi(
        "lightning_fabric.wrappers",
        "_FabricOptimizer",
        "lightning-fabric 2.4.0, 2.6.6",
        attributes=("(self.__class__, optimizer.__class__)",),
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
    PrivateApi(
        "lightning_fabric.strategies.ddp",
        "DDPStrategy",
        "lightning-fabric 2.4.0, 2.6.6",
        attributes=("self._timeout",),
    ),
)


def process_group_timeout(strategy: Any) -> timedelta | None:
    """The ``timeout`` a Fabric DDP strategy gives its process group (``DDPStrategy(timeout=...)``)."""
    return strategy._timeout


#: Horovod's optimizer methods that Fabric's wrapper reaches through its class (it defines ``step`` itself).
_HOROVOD_METHODS = ("zero_grad", "synchronize", "skip_synchronize", "set_backward_passes_per_step")


def route_horovod_methods_to(optimizer: Any) -> None:
    """Make Horovod's optimizer methods act on ``optimizer`` itself when called through Fabric's wrapper.

    The wrapper's class subclasses the optimizer's, so Horovod's ``super(self.__class__, self).zero_grad()``
    would recurse without end, and ``synchronize`` would flag the wrapper. The class is ``optimizer``'s own
    (Horovod builds one per ``DistributedOptimizer`` call), so its methods are rebound to ``optimizer``.
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


#: The interface a strategy implements for ``fabric.no_backward_sync`` (its ``_backward_sync_control``).
BackwardSyncControl = _BackwardSyncControl
