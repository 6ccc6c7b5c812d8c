"""adasum-lightning: Adasum (adaptive summation) as PyTorch Lightning 2.x strategies.

``import adasum_lightning`` registers ``"horovod_adasum"``, ``"horovod"``, ``"ddp_adasum"`` and
``"fsdp_adasum"`` with the Trainer's and Fabric's registries of each Lightning package once it is imported;
a bare ``adasum_lightning.X`` is the class for the package this process imported. Importing this package
imports neither Lightning nor Horovod.
"""

from __future__ import annotations

from typing import Any

from adasum_lightning import _namespaces
from adasum_lightning.allreduce import adasum_allreduce
from adasum_lightning.launch_environment import launcher_rank
from adasum_lightning.optimizer import AdasumOptimizer
from adasum_lightning.reference import adasum, adasum_reduce
from adasum_lightning.step import adasum_step
from adasum_lightning.uneven import EvenBatches

__version__ = "0.2.0"

#: Names resolved to the strategies of the Lightning package in use (see :func:`_namespaces.resolve`).
_PER_PACKAGE = (
    "HorovodAdasumStrategy",
    "HorovodStrategy",
    "DDPAdasumStrategy",
    "FSDPAdasumStrategy",
    "HorovodEnvironment",
)

__all__ = [
    *_PER_PACKAGE,
    "AdasumOptimizer",
    "EvenBatches",
    "adasum",
    "adasum_allreduce",
    "adasum_reduce",
    "adasum_step",
]


def __getattr__(name: str) -> Any:
    if name in _PER_PACKAGE:
        return getattr(_namespaces.strategies_for(_namespaces.resolve()), name)
    raise AttributeError(f"module 'adasum_lightning' has no attribute {name!r}")


def _set_rank_zero_from_launcher() -> None:  # only where a Lightning package is installed
    # Under mpirun only OMPI_* are set, so Lightning's rank_zero_only would be 0 on every rank until fit.
    import wrapt

    rank = launcher_rank()
    if rank != 0:
        wrapt.register_post_import_hook(
            lambda module: setattr(module.rank_zero_only, "rank", rank), "lightning_utilities.core.rank_zero"
        )


if _namespaces.installed((*_namespaces.NAMESPACES, *_namespaces.FABRIC_NAMESPACES)):
    _namespaces.register_when_imported()
    _set_rank_zero_from_launcher()
