"""The old name of :mod:`adasum_lightning.trainer` (the strategies for ``pytorch_lightning.Trainer``), kept so
that ``from adasum_lightning.pytorch_lightning import DDPAdasumStrategy`` goes on working."""

from adasum_lightning.trainer import *  # noqa: F401,F403
from adasum_lightning.trainer import STRATEGIES, __all__, register_strategies  # noqa: F401
