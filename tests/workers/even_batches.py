"""Worker (torchrun): ``EvenBatches`` in a plain loop; rank r's loader has 4 + r batches; OUT/rank{r}.pt.

usage: torchrun --nproc-per-node N -m tests.workers.even_batches OUT {sized,iterable} {truncate,error}
"""

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from adasum_lightning.uneven import EvenBatches, UnevenInputsError

out, kind, uneven = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo")
rank = dist.get_rank()
batches = [torch.full((2,), float(i)) for i in range(4 + rank)]
source = batches if kind == "sized" else iter(batches)  # a list has a len(); an iterator has not
seen, error = [], None
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        seen = [int(b[0]) for b in EvenBatches(source, uneven=uneven)]
    except UnevenInputsError as err:
        error = str(err)
messages = [str(w.message) for w in caught]
torch.save({"seen": seen, "warnings": messages, "error": error}, out / f"rank{rank}.pt")
dist.destroy_process_group()
