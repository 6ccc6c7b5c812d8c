"""Worker: rank 0 deletes one rank's optimizer file beside the checkpoint in a folder (a lost rank file).

usage: python -m tests.workers.drop_rank_file OUT CKPT_DIR RANK [--devices N]
(OUT and --devices are unused: the case runner and Lightning's launch pass them)
"""

from pathlib import Path

from adasum_lightning.checkpoint import rank_optimizer_path
from tests.workers import cases

folder, lost = cases.argv()[1:3]
if cases.rank() == 0:
    (ckpt,) = Path(folder).rglob("*.ckpt")
    Path(rank_optimizer_path(ckpt, int(lost))).unlink()
