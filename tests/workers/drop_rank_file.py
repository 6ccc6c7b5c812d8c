"""Worker: rank 0 deletes one rank's optimizer file beside the checkpoint in a folder (a lost rank file).

usage: python -m tests.workers.drop_rank_file OUT CKPT_DIR RANK   (OUT is unused: the case runner passes it)
"""

from pathlib import Path

from adasum_lightning.trainer._base import rank_optimizer_path
from tests.workers import cases

_, folder, lost = cases.argv()
if cases.rank() == 0:
    (ckpt,) = Path(folder).rglob("*.ckpt")
    Path(rank_optimizer_path(ckpt, int(lost))).unlink()
