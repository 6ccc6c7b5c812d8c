"""Worker (Lightning's launcher): ``Trainer(strategy=FSDPAdasumStrategy(shard_size=S))`` on the tiny net;
every rank saves OUT/rank{r}.pt.

usage: python -m tests.workers.fsdp_trainer OUT --shard-size S --max-steps N [--save] [--resume CKPT]
       [--strategy ddp_adasum] [--accumulate K] [--clip-norm X] [--freeze] [--bf16] [--checkpointing]
       --devices W

The data of ``tests/workers/fsdp.py``'s plain loop: micro-batch m of global step t is batch ``b = t·K + m``
(K = ``--accumulate``, Lightning's ``accumulate_grad_batches``) and rank r trains on the samples
``(b·W + r)·4 … +3`` of ``IndexedData(64)`` (chosen from the global step, so that a resumed fit continues
with the next step's batches), SGD (lr 0.1, momentum 0.9), the tiny net from seed 100. ``--clip-norm``:
Lightning's ``gradient_clip_val`` (norm); ``--freeze``: the first layer's parameters ``requires_grad=False``
(still in the optimizer); ``--bf16``: FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)`` (the dtypes of the forward's outputs and of the sharded parameters are saved);
``--checkpointing``: the net's forward under ``torch.utils.checkpoint`` (recomputed in backward);
``--configure-model``: ``configure_model`` shards each layer on ``self.device_mesh["shard"]`` and moves the
shards of the groups other than 0 away (the strategy gives them group 0's); ``--state-dict-type sharded``:
the checkpoint is a folder of ``torch.distributed.checkpoint`` shards.

Saves the full parameters at the start and the end, the local shards of the parameters and of the
momentum, the batches, the modules FSDP2 sharded, the momentum shards when training starts (after a
resume's restore) and, with ``--save``, writes the checkpoint OUT/ckpt at the end (``--resume``: fit from
one). ``--strategy ddp_adasum``: the same training with every rank a replica (its checkpoint for a resume
with fsdp_adasum).
"""

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from adasum_lightning.sharded import full_state_dict
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
p.add_argument("--accumulate", type=int, default=1)
p.add_argument("--clip-norm", type=float, default=None)
p.add_argument("--freeze", action="store_true")
p.add_argument("--bf16", action="store_true")
p.add_argument("--checkpointing", action="store_true")
p.add_argument("--configure-model", action="store_true")
p.add_argument("--state-dict-type", default="full", choices=("full", "sharded"))
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
        if args.freeze:
            self.net[0].requires_grad_(False)
        self.data = IndexedData(64)
        self.batches: list[list[int]] = []
        self.output_dtypes: list[str] = []

    def forward(self, x):
        if args.checkpointing:
            y = torch.utils.checkpoint.checkpoint(self.net, x, use_reentrant=False)
        else:
            y = self.net(x)
        self.output_dtypes.append(str(y.dtype))
        return y.float()

    def configure_model(self):
        if not args.configure_model or isinstance(self.net[0], FSDPModule):
            return
        for layer in self.net:  # each layer on the strategy's mesh["shard"]
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=self.device_mesh["shard"])
        if self.global_rank >= args.shard_size:  # groups other than 0 start elsewhere: they take group 0's
            with torch.no_grad():
                for q in self.net.parameters():
                    q.to_local().add_(1.0)

    def training_step(self, batch, batch_idx):
        number = self.global_step * args.accumulate + batch_idx % args.accumulate
        first = (number * self.trainer.world_size + self.global_rank) * BATCH
        idx = [(first + i) % 64 for i in range(BATCH)]
        self.batches.append(idx)
        return F.cross_entropy(self(self.data.x[idx]), self.data.y[idx])

    def train_dataloader(self):
        return DataLoader(range(1000), batch_size=1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def on_train_start(self):
        self.start = whole_state(self)
        self.resumed_momentum = momentum(self, self.trainer.optimizers[0])


def whole_state(module) -> dict:
    """The whole parameters (gathered over the shard group), whatever the checkpoints' layout."""
    if args.strategy == "fsdp_adasum":
        return full_state_dict(module, module.trainer.strategy.shard_group)
    return module.trainer.strategy.lightning_module_state_dict()


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def momentum(module, optimizer) -> dict:
    state = optimizer.state
    named = module.named_parameters()
    return {k.removeprefix("net."): local(state[q]["momentum_buffer"]) for k, q in named if q in state}


if args.strategy == "fsdp_adasum":
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else None
    strategy = adasum_strategies.FSDPAdasumStrategy(
        shard_size=args.shard_size, mp_policy=bf16, state_dict_type=args.state_dict_type
    )
else:
    strategy = adasum_strategies.DDPAdasumStrategy()
trainer = pl.Trainer(
    accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.max_steps,
    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    use_distributed_sampler=False, accumulate_grad_batches=args.accumulate, gradient_clip_val=args.clip_norm,
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
        "end": {k.removeprefix("net."): v for k, v in whole_state(module).items()},
        "local": {k.removeprefix("net."): local(q) for k, q in module.named_parameters()},
        "momentum": momentum(module, trainer.optimizers[0]),
        "resumed_momentum": module.resumed_momentum,
        "batches": module.batches,
        "sharded": sorted(n for n, m in module.named_modules() if isinstance(m, FSDPModule)),
        "mesh": strategy.device_mesh.mesh.tolist() if args.strategy == "fsdp_adasum" else None,
        "output_dtypes": sorted(set(module.output_dtypes)),
        "parameter_dtypes": sorted({str(q.dtype) for q in module.parameters()}),
    },
    out / f"rank{rank}.pt",
)
