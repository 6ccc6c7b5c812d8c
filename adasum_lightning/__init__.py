"""adasum-lightning: Adasum (adaptive summation) as PyTorch Lightning 2.x strategies.

``import adasum_lightning`` registers four strategy names with Lightning's ``StrategyRegistry`` (of
``pytorch_lightning`` and of ``lightning.pytorch``, each once that package is imported), and with Fabric's:

- ``"horovod_adasum"``: :class:`HorovodAdasumStrategy`, Horovod's Adasum of parameter deltas under
  ``horovodrun``/``mpirun``; no learning-rate scaling;
- ``"horovod"``: :class:`HorovodStrategy`, Horovod's gradient averaging, learning rate × world size
  (pytorch-lightning 1.x's ``strategy="horovod"``);
- ``"ddp_adasum"``: :class:`DDPAdasumStrategy`, Adasum of parameter deltas on ``torch.distributed``, launched
  by Lightning, ``torchrun``, SLURM or Azure ML; no Horovod needed.
- ``"fsdp_adasum"``: :class:`FSDPAdasumStrategy`, Adasum of parameter deltas across replica groups of ranks,
  each group sharding the model with FSDP2 (:mod:`adasum_lightning.sharded`).

The classes exist once per Lightning package (:mod:`adasum_lightning._namespaces`):
``adasum_lightning.trainer.X`` for ``pytorch_lightning.Trainer``, ``adasum_lightning.lightning.X`` for
``lightning.pytorch.Trainer``; a bare ``adasum_lightning.X`` is the one of the package this process imported.
Importing this package imports neither Lightning nor Horovod. With ``torch`` alone, :class:`AdasumOptimizer`,
:func:`adasum_allreduce` and :func:`adasum_step` work; a strategy class then raises an ``ImportError`` naming
the pip command.
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
    # Lightning reads RANK/LOCAL_RANK/… when it is imported; under mpirun only OMPI_* are set, so every rank
    # would print rank-zero messages until fit starts. Both Lightning packages share lightning_utilities'
    # ``rank_zero_only``: give it the launcher's rank once it is imported (no Horovod initialisation).
    import wrapt

    rank = launcher_rank()
    if rank != 0:
        wrapt.register_post_import_hook(
            lambda module: setattr(module.rank_zero_only, "rank", rank), "lightning_utilities.core.rank_zero"
        )


if _namespaces.installed((*_namespaces.NAMESPACES, *_namespaces.FABRIC_NAMESPACES)):
    _namespaces.register_when_imported()
    _set_rank_zero_from_launcher()
