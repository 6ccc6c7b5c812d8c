"""Worker (Lightning's launcher): ``Fabric(strategy=FSDPAdasumStrategy(shard_size=S))`` on the tiny net; every
rank saves OUT/rank{r}.pt.

usage: python -m tests.workers.fsdp_fabric OUT --shard-size S --steps N [--accumulate K] [--clip-norm X]
       [--joint] [--save] [--resume CKPT] [--stale-optimizer] --devices W

The data of ``tests/workers/fsdp.py``'s plain loop and of ``fsdp_trainer.py``: micro-batch m of optimizer
step t is batch ``b = t·K + m``, and rank r trains on the samples ``(b·W + r)·4 … +3`` of ``IndexedData(64)``;
SGD (lr 0.1, momentum 0.9); the tiny net from seed 100 + rank (the strategy gives every rank rank 0's, seed
100's). ``model = fabric.setup_module(model)`` then ``fabric.setup_optimizers(SGD(model.parameters()))``, or
with ``--joint`` ``fabric.setup(model, SGD(model.parameters()))`` (the optimizer built before sharding,
rebound by the strategy). ``--accumulate K``: ``fabric.no_backward_sync`` on the first K − 1 micro-batches,
the loss ÷ K. ``--clip-norm``: ``fabric.clip_gradients(max_norm=X)`` before each step (the norms it returned
are saved). ``--save``: ``fabric.save(OUT/ckpt, {"model", "optimizer", "step"})`` at the end; ``--resume``:
``fabric.load`` into the objects set up, then the steps left (``--state-dict-type sharded``: a folder of
``torch.distributed.checkpoint`` shards). ``--stale-optimizer``: an optimizer built
before ``setup_module``, set up after it (refused).

Saves what ``fsdp_trainer.py`` saves: the full parameters at the start (after a resume's load) and the end,
the local shards of the parameters and of the momentum, the batches, the modules FSDP2 sharded and the mesh.
"""

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning_fabric import Fabric
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from adasum_lightning.fabric import FSDPAdasumStrategy
from tests.workers import cases
from tests.workers.samples import IndexedData, tiny_net

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--shard-size", type=int, required=True)
p.add_argument("--steps", type=int, default=3)
p.add_argument("--accumulate", type=int, default=1)
p.add_argument("--clip-norm", type=float, default=None)
p.add_argument("--joint", action="store_true")
p.add_argument("--save", action="store_true")
p.add_argument("--resume", default=None)
p.add_argument("--stale-optimizer", action="store_true")
p.add_argument("--state-dict-type", default="full", choices=("full", "sharded"))
p.add_argument("--devices", type=int, required=True)
args = p.parse_args(cases.argv())
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
BATCH, LR, MOMENTUM, K = 4, 0.1, 0.9, args.accumulate


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


strategy = FSDPAdasumStrategy(shard_size=args.shard_size, state_dict_type=args.state_dict_type)
fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
fabric.launch()
rank, world = fabric.global_rank, fabric.world_size
torch.manual_seed(100 + rank)
net = tiny_net()
if args.stale_optimizer:
    stale = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    model = fabric.setup_module(net)
    fabric.setup_optimizers(stale)  # refused: the parameters it holds were replaced by fully_shard
if args.joint:
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM))
else:
    model = fabric.setup_module(net)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM))
module, inner = model.module, optimizer.optimizer
first_step, resumed_momentum = 0, {}
if args.resume:
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(args.resume, state)
    first_step = state["step"]
    resumed_momentum = {k: local(inner.state[q]["momentum_buffer"]) for k, q in module.named_parameters()}
start = strategy.get_module_state_dict(module)
data = IndexedData(64)
batches, norms = [], []
for step in range(first_step, args.steps):
    for m in range(K):
        first = ((step * K + m) * world + rank) * BATCH
        idx = [(first + i) % 64 for i in range(BATCH)]
        batches.append(idx)
        with fabric.no_backward_sync(model, enabled=m < K - 1):
            fabric.backward(F.cross_entropy(model(data.x[idx]), data.y[idx]) / K)
    if args.clip_norm is not None:
        norm = fabric.clip_gradients(model, optimizer, max_norm=args.clip_norm)
        norms.append(float(norm.to_local() if isinstance(norm, DTensor) else norm))
    optimizer.step()
    optimizer.zero_grad()
if args.save:
    fabric.save(out / "ckpt", {"model": model, "optimizer": optimizer, "step": args.steps})
torch.save(
    {
        "rank": rank,
        "world_size": world,
        "steps": args.steps,
        "start": start,
        "end": strategy.get_module_state_dict(module),
        "local": {k: local(q) for k, q in module.named_parameters()},
        "momentum": {k: local(inner.state[q]["momentum_buffer"]) for k, q in module.named_parameters()},
        "resumed_momentum": resumed_momentum,
        "batches": batches,
        "norms": norms,
        "sharded": sorted(n for n, m in module.named_modules() if isinstance(m, FSDPModule)),
        "mesh": strategy.device_mesh.mesh.tolist(),
    },
    out / f"rank{rank}.pt",
)
fabric.barrier()
