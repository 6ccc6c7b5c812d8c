"""Worker: a real horovodrun fit of a small dropout-free model; rank 0 saves its final parameters.

The test replays the same job with :func:`benchmarks.simulate.simulate` and compares.

usage: sim_match.py OUT_DIR --strategy horovod_adasum|horovod [--steps K] [--seed S]
"""

import argparse
import os
from pathlib import Path

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import adasum_lightning
from tests.workers import cases
from tests.workers.lightning import pl

BATCH = 8
LR = 0.2


def teacher_data(n: int = 1024) -> TensorDataset:
    """``n`` samples ``x (16,) float32`` labelled by a fixed random linear teacher into 4 classes."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, 16, generator=gen)
    y = (x @ torch.randn(16, 4, generator=gen)).argmax(1)
    return TensorDataset(x, y)


class SimNet(pl.LightningModule):
    """MLP 16 → 32 (tanh) → 4, SGD momentum 0.9, linear one-cycle over ``total_steps``; no dropout."""

    def __init__(self, total_steps: int = 300) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        self.total_steps = total_steps

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def train_dataloader(self):
        return DataLoader(teacher_data(), batch_size=BATCH, shuffle=True)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)
        sched = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=LR, total_steps=self.total_steps, anneal_strategy="linear", cycle_momentum=False
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--strategy", default="horovod_adasum")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args(cases.argv())
    torch.set_num_threads(1)
    # Each rank seeds differently (as separate machines might); rank 0's weights are broadcast.
    pl.seed_everything(args.seed + int(os.environ.get("OMPI_COMM_WORLD_RANK", "0")), verbose=False)
    model = SimNet(total_steps=args.steps)
    trainer = pl.Trainer(
        strategy=args.strategy,
        accelerator="cpu",
        devices=1,
        max_steps=args.steps,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    if hvd.rank() == 0:
        torch.save(
            {
                "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "global_step": trainer.global_step,
                "world_size": hvd.size(),
                "sampler_seed": int(os.environ["PL_GLOBAL_SEED"]),
                "adasum_version": adasum_lightning.__version__,
            },
            Path(args.out) / "rank0.pt",
        )


if __name__ == "__main__":
    main()
