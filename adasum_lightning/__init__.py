"""adasum-lightning: Horovod's Adasum as a PyTorch Lightning 2.x strategy.

``import adasum_lightning`` registers two strategy names with Lightning's registry:

- ``"horovod_adasum"``: :class:`HorovodAdasumStrategy` (Adasum of parameter deltas, no learning-rate
  scaling by world size);
- ``"horovod"``: :class:`HorovodStrategy` (gradient averaging, learning rate × world size, as in
  pytorch-lightning 1.x).

Importing does not initialise Horovod; that happens when ``Trainer.fit`` starts.
"""

from pytorch_lightning.strategies import StrategyRegistry
from pytorch_lightning.utilities.rank_zero import rank_zero_only

from adasum_lightning.allreduce import adasum_allreduce
from adasum_lightning.environment import HorovodEnvironment, launcher_rank
from adasum_lightning.ops import adasum, adasum_reduce
from adasum_lightning.strategy import HorovodAdasumStrategy, HorovodStrategy

__version__ = "0.1.0"
__all__ = [
    "HorovodAdasumStrategy",
    "HorovodStrategy",
    "HorovodEnvironment",
    "adasum",
    "adasum_allreduce",
    "adasum_reduce",
]

HorovodStrategy.register_strategies(StrategyRegistry)
HorovodAdasumStrategy.register_strategies(StrategyRegistry)

# Lightning reads RANK/LOCAL_RANK/… at import; under mpirun only OMPI_* are set, so every rank would
# print rank-zero messages until fit starts. Take the launcher's rank now (no Horovod initialisation).
if launcher_rank() != 0:
    rank_zero_only.rank = launcher_rank()
