"""Worker (Lightning's launcher): ``Trainer(strategy=FSDPAdasumStrategy(shard_size=S))`` on the tiny net;
every rank saves OUT/rank{r}.pt.

usage: python -m tests.workers.fsdp_trainer OUT --shard-size S --max-steps N [--save] [--resume CKPT]
       [--strategy ddp_adasum] --devices W

The data of ``tests/workers/fsdp.py``'s plain loop: at global step t rank r trains on the samples
``(t·W + r)·4 … +3`` of ``IndexedData(64)`` (chosen from the global step, so that a resumed fit continues
with the next step's batches), SGD (lr 0.1, momentum 0.9), the tiny net from seed 100. Saves the full
parameters at the start and the end, the local shards of the parameters and of the momentum, the batches,
the modules FSDP2 sharded, the momentum shards when training starts (after a resume's restore) and, with
``--save``, writes the checkpoint OUT/ckpt at the end (``--resume``: fit from one). ``--strategy
ddp_adasum``: the same training with every rank a replica (its checkpoint for a resume with fsdp_adasum).
"""

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from tests.workers import cases
from tests.workers.lightning import adasum_strategies, pl
from tests.workers.samples import IndexedData, tiny_net

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--shard-size", type=int, required=True)
p.add_argument("--max-steps", type=int, default=3)
p.add_argument("--save", action="store_true")
p.add_argument("--strategy", default="fsdp_adasum", choices=("fsdp_adasum", "ddp_adasum"))
p.add_argument("--resume", default=None)
p.add_argument("--devices", type=int, required=True)
args = p.parse_args(cases.argv())
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
BATCH = 4


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(100)
        self.net = tiny_net()
        self.data = IndexedData(64)
        self.batches: list[list[int]] = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        first = (self.global_step * self.trainer.world_size + self.global_rank) * BATCH
        idx = [(first + i) % 64 for i in range(BATCH)]
        self.batches.append(idx)
        return F.cross_entropy(self(self.data.x[idx]), self.data.y[idx])

    def train_dataloader(self):
        return DataLoader(range(1000), batch_size=1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def on_train_start(self):
        self.start = self.trainer.strategy.lightning_module_state_dict()
        self.resumed_momentum = momentum(self, self.trainer.optimizers[0])


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def momentum(module, optimizer) -> dict:
    state = optimizer.state
    named = module.named_parameters()
    return {k.removeprefix("net."): local(state[q]["momentum_buffer"]) for k, q in named if q in state}


if args.strategy == "fsdp_adasum":
    strategy = adasum_strategies.FSDPAdasumStrategy(shard_size=args.shard_size)
else:
    strategy = adasum_strategies.DDPAdasumStrategy()
trainer = pl.Trainer(
    accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.max_steps,
    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    use_distributed_sampler=False,
)  # fmt: skip
module = Module()
trainer.fit(module, ckpt_path=args.resume)
if args.save:
    trainer.save_checkpoint(out / "ckpt")
rank = trainer.global_rank
torch.save(
    {
        "rank": rank,
        "world_size": trainer.world_size,
        "steps": trainer.global_step,
        "start": {k.removeprefix("net."): v for k, v in module.start.items()},
        "end": {k.removeprefix("net."): v for k, v in strategy.lightning_module_state_dict().items()},
        "local": {k.removeprefix("net."): local(q) for k, q in module.named_parameters()},
        "momentum": momentum(module, trainer.optimizers[0]),
        "resumed_momentum": module.resumed_momentum,
        "batches": module.batches,
        "sharded": sorted(n for n, m in module.named_modules() if isinstance(m, FSDPModule)),
        "mesh": strategy.device_mesh.mesh.tolist() if args.strategy == "fsdp_adasum" else None,
    },
    out / f"rank{rank}.pt",
)
