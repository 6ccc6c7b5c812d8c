"""Worker: a short fit that imports ONE Lightning package, with a strategy given by name or as an instance.

usage: python -m tests.workers.packages OUT_DIR --package pytorch_lightning|lightning.pytorch
           --strategy NAME --by name|instance [--devices N]

The script imports only the package it is told to (as a user's script would: ``import lightning as L`` or
``import pytorch_lightning as pl``) and ``adasum_lightning``; every rank saves its parameters, the
``sync_dist`` logged value and which Lightning packages ended up imported to ``OUT_DIR/rank{r}.pt``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.workers import cases  # imports no Lightning package

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--package", required=True, choices=["pytorch_lightning", "lightning.pytorch"])
p.add_argument("--strategy", required=True)
p.add_argument("--by", required=True, choices=["name", "instance"])
p.add_argument("--devices", type=int, default=1)
args = p.parse_args(cases.argv())

if args.package == "lightning.pytorch":
    import lightning as L

    pl = L.pytorch
else:
    pl = importlib.import_module("pytorch_lightning")
import adasum_lightning  # noqa: E402

CLASSES = {
    "horovod_adasum": "HorovodAdasumStrategy",
    "horovod": "HorovodStrategy",
    "ddp_adasum": "DDPAdasumStrategy",
}


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("rank_plus_one", float(self.global_rank + 1), sync_dist=True, on_step=False, on_epoch=True)
        return loss

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(32, 4, generator=gen)
        return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


rank_env = next(
    (os.environ[n] for n in ("OMPI_COMM_WORLD_RANK", "RANK", "LOCAL_RANK") if os.environ.get(n)), "0"
)
pl.seed_everything(10 + int(rank_env))  # different initial weights per rank
strategy = args.strategy if args.by == "name" else getattr(adasum_lightning, CLASSES[args.strategy])()
trainer = pl.Trainer(
    strategy=strategy,
    accelerator="cpu",
    devices=args.devices,
    max_epochs=2,
    enable_progress_bar=False,
    enable_model_summary=False,
    logger=False,
    enable_checkpointing=False,
)
model = Model()
trainer.fit(model)
torch.save(
    {
        "end": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "strategy_class": f"{type(trainer.strategy).__module__}.{type(trainer.strategy).__name__}",
        "strategy_base": [f"{c.__module__}.{c.__name__}" for c in type(trainer.strategy).__mro__],
        "logged": float(trainer.callback_metrics["rank_plus_one"]),
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "imported": sorted(m for m in ("pytorch_lightning", "lightning") if m in sys.modules),
    },
    Path(args.out) / f"rank{trainer.global_rank}.pt",
)
