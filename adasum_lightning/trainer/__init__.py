"""The strategies for ``pytorch_lightning.Trainer``; loaded as ``adasum_lightning.lightning`` for
``lightning.pytorch`` with the package names renamed (:mod:`adasum_lightning._namespaces`)."""

from __future__ import annotations

from typing import Any

from pytorch_lightning.strategies import StrategyRegistry

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
    _strategy.register_strategies(StrategyRegistry)

import adasum_lightning.horovod.trainer as _horovod  # noqa: E402  (registers them; last: it imports this package)


def __getattr__(name: str) -> Any:  # the Horovod strategies: that module imports this package first
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(_horovod, name)
