"""The old name of :mod:`adasum_lightning.trainer.horovod`."""

from adasum_lightning.trainer.horovod import *  # noqa: F401,F403
from adasum_lightning.trainer.horovod import __all__  # noqa: F401
