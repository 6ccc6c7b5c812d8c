"""The private APIs the Fabric strategies use, checked by :func:`adasum_lightning._private_apis.missing`
(read from lightning-fabric 2.4.0 and 2.6.6)."""

from __future__ import annotations

from lightning_fabric.strategies.strategy import _BackwardSyncControl

from adasum_lightning._private_apis import PrivateApi

__all__ = ["PRIVATE_APIS", "BackwardSyncControl"]

_BOTH, _STRATEGY = "lightning-fabric 2.4.0, 2.6.6", "lightning_fabric.strategies.strategy"
PRIVATE_APIS: tuple[PrivateApi, ...] = (
    # The interface behind fabric.no_backward_sync; a strategy sets _backward_sync_control to one.
    PrivateApi(_STRATEGY, "_BackwardSyncControl", _BOTH),
    # A strategy that starts no processes sets _launcher to None in _configure_launcher (the Horovod ones).
    PrivateApi(
        _STRATEGY,
        "Strategy",
        _BOTH,
        ("self._backward_sync_control", "self._launcher", "def _configure_launcher"),
    ),
    # Fabric's optimizer wrapper subclasses the wrapped optimizer's class (so Horovod's methods are rebound:
    # adasum_lightning.horovod._compat.route_horovod_methods_to).
    PrivateApi(
        "lightning_fabric.wrappers", "_FabricOptimizer", _BOTH, ("(self.__class__, optimizer.__class__)",)
    ),
    PrivateApi(
        "lightning_fabric.strategies.ddp", "DDPStrategy", _BOTH, ("self._timeout", "self._ddp_kwargs")
    ),
)


#: The interface a strategy implements for ``fabric.no_backward_sync`` (its ``_backward_sync_control``).
BackwardSyncControl = _BackwardSyncControl
