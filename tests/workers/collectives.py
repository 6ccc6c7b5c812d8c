"""Worker: Horovod's Adasum allreduce vs the reference operator, and the strategy's collectives.

usage: collectives.py OUT_DIR        (every rank writes OUT_DIR/rank{r}.pt)
"""

from pathlib import Path

import horovod.torch as hvd
import torch

from adasum_lightning.reference import adasum_reduce
from tests.workers import cases
from tests.workers.lightning import HorovodAdasumStrategy, pl

argv = cases.argv()
out = Path(argv[0])
hvd.init()
rank, size = hvd.rank(), hvd.size()
result = {"rank": rank, "size": size, "adasum": {}}

for dtype in (torch.float64, torch.float32):
    for shape in ((7,), (33, 5), (1000,)):
        gen = torch.Generator().manual_seed(1000 + 17 * rank + len(shape))
        mine = torch.randn(shape, generator=gen, dtype=dtype)
        everyone = hvd.allgather(mine.unsqueeze(0))  # (size, *shape): every rank's input
        reduced = hvd.allreduce(mine.clone(), op=hvd.Adasum, name=f"adasum.{dtype}.{shape}")
        reference = adasum_reduce(list(everyone.unbind(0)))
        rel = ((reduced - reference).abs().max() / reference.abs().max()).item()
        result["adasum"][(str(dtype), shape)] = {
            "max_abs": (reduced - reference).abs().max().item(),
            "rel": rel,
        }

# Orthogonal inputs (one-hot per rank) add; identical inputs stay.
onehot = torch.zeros(size, dtype=torch.float64)
onehot[rank] = 1.0
result["orthogonal"] = hvd.allreduce(onehot, op=hvd.Adasum, name="orth")
result["identical"] = hvd.allreduce(torch.arange(4, dtype=torch.float64), op=hvd.Adasum, name="same")
# One rank's update is all zeros: the others' result comes through, no NaN.
zero_on_0 = (
    torch.zeros(3, dtype=torch.float64) if rank == 0 else torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
)
result["zero_rank0"] = hvd.allreduce(zero_on_0, op=hvd.Adasum, name="zero")

# The strategy's collectives (used by self.log(sync_dist=True), torchmetrics, checkpoints): Lightning's DDP
# collectives on the torch.distributed process group the strategy creates beside Horovod.
strategy = HorovodAdasumStrategy(
    accelerator=pl.accelerators.CPUAccelerator(), parallel_devices=[torch.device("cpu")]
)
strategy.setup_environment()
value = torch.tensor([float(rank + 1)])
# (in place, as under DDP: each call gets its own copy)
result["reduce_mean"] = strategy.reduce(value.clone(), reduce_op="mean")
result["reduce_sum"] = strategy.reduce(value.clone(), reduce_op="sum")
result["reduce_max"] = strategy.reduce(value.clone(), reduce_op="max")
result["all_gather"] = strategy.all_gather(torch.tensor([rank, 10 * rank]))
result["broadcast"] = strategy.broadcast({"from": rank, "list": [rank] * 3}, src=size - 1)
strategy.barrier()
result["global_rank"], result["world_size"] = strategy.global_rank, strategy.world_size

torch.save(result, out / f"rank{rank}.pt")
