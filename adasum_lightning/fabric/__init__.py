"""The strategies for ``lightning_fabric.Fabric`` (and, loaded as ``adasum_lightning.lightning.fabric``, for
``lightning.fabric.Fabric``; see :mod:`adasum_lightning._namespaces`).

This subpackage imports ``lightning_fabric`` by name (never ``pytorch_lightning``: ``pip install
lightning-fabric`` alone is enough) and its own modules relatively: its copy for the unified package is the
same files with that name renamed.
"""

from __future__ import annotations

from typing import Any

from lightning_fabric.strategies import STRATEGY_REGISTRY

from .ddp_adasum import DDPAdasumStrategy
from .environment import HorovodEnvironment
from .horovod import HorovodAdasumStrategy, HorovodStrategy

__all__ = [
    "DDPAdasumStrategy",
    "HorovodAdasumStrategy",
    "HorovodEnvironment",
    "HorovodStrategy",
    "register_strategies",
]

#: The Fabric strategies ``import adasum_lightning`` registers, by name.
STRATEGIES = (HorovodAdasumStrategy, HorovodStrategy, DDPAdasumStrategy)


def register_strategies(strategy_registry: Any) -> None:
    """Add ``ddp_adasum`` to Fabric's registry (``lightning_fabric.strategies.STRATEGY_REGISTRY``)."""
    for strategy in STRATEGIES:
        strategy.register_strategies(strategy_registry)


register_strategies(STRATEGY_REGISTRY)
