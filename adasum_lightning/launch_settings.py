"""The old name of :mod:`adasum_lightning.fault_tolerance`, kept so that existing imports go on working."""

from adasum_lightning.fault_tolerance import *  # noqa: F401,F403
from adasum_lightning.fault_tolerance import __all__  # noqa: F401
