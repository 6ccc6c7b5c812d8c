"""The strategies for ``pytorch_lightning.Trainer`` (and, loaded as ``adasum_lightning.lightning``, for
``lightning.pytorch.Trainer``; see :mod:`adasum_lightning._namespaces`).

This subpackage imports ``pytorch_lightning``/``lightning_fabric`` by name and its own modules relatively:
its copy for the unified package is the same files with those two names renamed.
"""

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

# Registered by name with the StrategyRegistry on import: Trainer(strategy="ddp_adasum").
for _strategy in (DDPAdasumStrategy, FSDPAdasumStrategy):
    _strategy.register_strategies(StrategyRegistry)

# Registers the Horovod strategies; last and as a module: importing that module first imports this package.
import adasum_lightning.horovod.trainer as _horovod  # noqa: E402


def __getattr__(name: str) -> Any:
    if name in ("HorovodAdasumStrategy", "HorovodEnvironment", "HorovodStrategy"):
        return getattr(_horovod, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
