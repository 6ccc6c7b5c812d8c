"""The old name of :mod:`adasum_lightning.trainer.ddp_adasum`."""

from adasum_lightning.trainer.ddp_adasum import *  # noqa: F401,F403
from adasum_lightning.trainer.ddp_adasum import __all__  # noqa: F401
