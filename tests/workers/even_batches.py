"""Worker (torchrun): ``EvenBatches`` in a plain loop; rank r's loader has 4 + r batches; OUT/rank{r}.pt.

usage: torchrun --nproc-per-node N -m tests.workers.even_batches OUT KIND {truncate,error}

KIND: ``sized`` (a list), ``iterable`` (an iterator), or ``promising`` (a DataLoader over an
IterableDataset whose ``len()`` says 5 on every rank, while rank r yields 4 + r items).
"""

import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from adasum_lightning.uneven import EvenBatches, UnevenInputsError
from tests.workers import cases

argv = cases.argv()
out, kind, uneven = Path(argv[0]), argv[1], argv[2]
cases.init_process_group("gloo")
rank = dist.get_rank()
batches = [torch.full((2,), float(i)) for i in range(4 + rank)]


class Promising(torch.utils.data.IterableDataset):
    def __len__(self) -> int:
        return 5

    def __iter__(self):
        return iter(batches)


sources = {
    "sized": batches,  # a list has a len()
    "iterable": iter(batches),  # an iterator has not
    "promising": torch.utils.data.DataLoader(Promising(), batch_size=None),
}
source = sources[kind]
seen, error = [], None
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        seen = [int(b[0]) for b in EvenBatches(source, uneven_inputs=uneven)]
    except UnevenInputsError as err:
        error = str(err)
messages = [str(w.message) for w in caught]
torch.save({"seen": seen, "warnings": messages, "error": error}, out / f"rank{rank}.pt")
cases.destroy_process_group()
