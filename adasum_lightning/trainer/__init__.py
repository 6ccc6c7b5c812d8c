"""The strategies for ``pytorch_lightning.Trainer`` (and, loaded as ``adasum_lightning.lightning``, for
``lightning.pytorch.Trainer``; see :mod:`adasum_lightning._namespaces`).

This subpackage imports ``pytorch_lightning``/``lightning_fabric`` by name and its own modules relatively:
its copy for the unified package is the same files with those two names renamed.
"""

from __future__ import annotations

from pytorch_lightning.strategies import StrategyRegistry

from adasum_lightning.fabric.environment import HorovodEnvironment

from .ddp_adasum import DDPAdasumStrategy
from .fsdp_adasum import FSDPAdasumStrategy
from .horovod import HorovodAdasumStrategy, HorovodStrategy

__all__ = [
    "DDPAdasumStrategy",
    "FSDPAdasumStrategy",
    "HorovodAdasumStrategy",
    "HorovodEnvironment",
    "HorovodStrategy",
]

# Registered by name with the StrategyRegistry on import: Trainer(strategy="ddp_adasum").
for _strategy in (HorovodAdasumStrategy, HorovodStrategy, DDPAdasumStrategy, FSDPAdasumStrategy):
    _strategy.register_strategies(StrategyRegistry)
