"""The strategies for ``lightning_fabric.Fabric`` (never ``pytorch_lightning``); loaded as
``adasum_lightning.lightning.fabric`` for ``lightning.fabric`` (:mod:`adasum_lightning._namespaces`)."""

from __future__ import annotations

from typing import Any

from lightning_fabric.strategies import STRATEGY_REGISTRY

from .ddp_adasum import DDPAdasumStrategy
from .fsdp_adasum import FSDPAdasumStrategy

__all__ = [
    "DDPAdasumStrategy",
    "FSDPAdasumStrategy",
    "HorovodAdasumStrategy",
    "HorovodEnvironment",
    "HorovodStrategy",
]

for _strategy in (DDPAdasumStrategy, FSDPAdasumStrategy):
    _strategy.register_strategies(STRATEGY_REGISTRY)

import adasum_lightning.horovod.fabric as _horovod  # noqa: E402  (registers them; last: it imports this package)


def __getattr__(name: str) -> Any:  # the Horovod strategies: that module imports this package first
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(_horovod, name)
