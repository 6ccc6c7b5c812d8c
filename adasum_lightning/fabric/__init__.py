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
from .fsdp_adasum import FSDPAdasumStrategy

__all__ = [
    "DDPAdasumStrategy",
    "FSDPAdasumStrategy",
    "HorovodAdasumStrategy",
    "HorovodEnvironment",
    "HorovodStrategy",
]

# Registered by name with the strategy registry on import: Fabric(strategy="ddp_adasum"),
# Fabric(strategy="fsdp_adasum").
for _strategy in (DDPAdasumStrategy, FSDPAdasumStrategy):
    _strategy.register_strategies(STRATEGY_REGISTRY)

# Registers the Horovod strategies; last and as a module: importing that module first imports this package.
import adasum_lightning.horovod.fabric as _horovod  # noqa: E402


def __getattr__(name: str) -> Any:
    if name in ("HorovodAdasumStrategy", "HorovodEnvironment", "HorovodStrategy"):
        return getattr(_horovod, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
