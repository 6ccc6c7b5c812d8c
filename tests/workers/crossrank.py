"""Worker: what Lightning does across ranks, under any of the project's strategies.

usage: python -m tests.workers.crossrank OUT_DIR --case CASE [--strategy NAME] [options]

Every rank saves what it saw to ``OUT_DIR/rank{r}.pt`` (after ``fit``, or from ``on_exception`` when training
stops early). Cases:

- ``batchnorm``: Linear → BatchNorm1d; each rank's data differ; ``--sync-batchnorm`` / ``--convert-sync-bn``.
- ``mask``: a ``torch.bool`` buffer (a mask) that differs per rank before fit.
- ``noncontiguous``: a parameter and a buffer that are transposed (non-contiguous) views.
- ``gather``: ``self.all_gather(x, sync_grads=True)`` with ``x = w·(rank+1)``, ``loss = gathered.sum()``;
  records the gradient that reaches ``w`` (a tensor hook: before any optimizer reduction).
- ``metrics``: ``trainer.validate`` with torchmetrics list states of different sizes per rank.
- ``lbfgs``: the tiny classifier trained with ``torch.optim.LBFGS``.
- ``sigterm``: rank 0 sends itself SIGTERM at ``--sigterm-step``; ``OnExceptionCheckpoint`` saves; with
  ``--sync-every H``, ``ddp_adasum``'s local SGD (windows of H steps, ``combine="mean"``; ``--overlap-sync``).
- ``long``: the tiny classifier for many slow epochs, writing ``OUT_DIR/pid{r}`` and ``OUT_DIR/step{r}``.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.workers import cases
from tests.workers.lightning import DDPAdasumStrategy, callbacks, pl

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--case", required=True)
p.add_argument("--strategy", default="horovod_adasum")
p.add_argument("--devices", type=int, default=1)
p.add_argument("--precision", default="32-true")
p.add_argument("--sync-batchnorm", action="store_true")
p.add_argument("--convert-sync-bn", action="store_true")
p.add_argument("--sigterm-step", type=int, default=3)
p.add_argument("--steps", type=int, default=4)
p.add_argument("--sync-every", type=int, default=1, help="> 1: ddp_adasum with windows of this many steps")
p.add_argument("--overlap-sync", action="store_true", help="with --sync-every: overlap_sync=True")
args = p.parse_args(cases.argv())
out = Path(args.out)


def rank_of_process() -> int:
    for name in ("OMPI_COMM_WORLD_RANK", "HOROVOD_RANK", "RANK"):
        if os.environ.get(name):
            return int(os.environ[name])
    return 0


def data(n: int = 32, seed: int = 0) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    return TensorDataset(x, (x[:, 0] > 0).long())


class Base(pl.LightningModule):
    """A tiny classifier (8 → 8 → 2); every rank records into ``self.record``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)
        self.record: dict = {"steps": []}

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.record["steps"].append(self.global_step)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def train_dataloader(self):
        return DataLoader(data(), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class BatchNormModule(Base):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        return self.head(self.bn(self.body(x)))

    def train_dataloader(self):
        # Each rank its own data (shifted by its rank), so that unsynchronised statistics differ.
        dataset = data(seed=self.global_rank)
        dataset.tensors[0].add_(3.0 * self.global_rank)
        return DataLoader(dataset, batch_size=4)


class MaskModule(Base):
    def __init__(self) -> None:
        super().__init__()
        mask = torch.zeros(8, dtype=torch.bool)
        mask[: 2 + rank_of_process()] = True  # differs per rank before fit
        self.register_buffer("mask", mask)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)) * self.mask)


class NonContiguousModule(Base):
    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Parameter(torch.randn(2, 8).t())  # (8, 2), non-contiguous
        self.register_buffer("scale", torch.rand(2, 8).t())  # non-contiguous buffer
        assert not self.extra.is_contiguous() and not self.scale.is_contiguous()

    def forward(self, x):
        return self.head(torch.tanh(self.body(x))) + x @ (self.extra * self.scale)


class GatherModule(Base):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.record["w_grads"] = []
        self.w.register_hook(lambda grad: self.record["w_grads"].append(grad.detach().clone()))

    def training_step(self, batch, batch_idx):
        x = self.w * (self.global_rank + 1)
        gathered = self.all_gather(x, sync_grads=True)
        self.record["gathered"] = gathered.detach().clone()
        return gathered.sum() + 0.0 * super().training_step(batch, batch_idx)


class MetricsModule(Base):
    def __init__(self) -> None:
        super().__init__()
        self.cat = torchmetrics.CatMetric()
        self.auroc = torchmetrics.classification.BinaryAUROC(ignore_index=-1)

    def validation_step(self, batch, batch_idx):
        r = self.global_rank
        count = 3 * (r + 1)  # ranks hold different numbers of samples
        values = torch.arange(count, dtype=torch.float32) + 100 * r
        self.cat.update(values)
        gen = torch.Generator().manual_seed(r)
        preds = torch.rand(count, generator=gen)
        target = torch.randint(0, 2, (count,), generator=gen)
        target[0] = -1  # ignored
        self.auroc.update(preds, target)

    def on_validation_epoch_end(self):
        self.record["cat"] = self.cat.compute().detach().clone()
        self.record["auroc"] = self.auroc.compute().detach().clone()

    def val_dataloader(self):
        return DataLoader(data(n=4), batch_size=4)


class LbfgsModule(Base):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=5)


class SlowModule(Base):
    def training_step(self, batch, batch_idx):
        (out / f"step{self.global_rank}").write_text(str(self.global_step))
        if args.case == "sigterm" and self.global_rank == 0 and self.global_step == args.sigterm_step:
            os.kill(os.getpid(), signal.SIGTERM)  # a preemption notice to rank 0 only
        time.sleep(0.05)
        return super().training_step(batch, batch_idx)


MODULES = {
    "batchnorm": BatchNormModule,
    "mask": MaskModule,
    "noncontiguous": NonContiguousModule,
    "gather": GatherModule,
    "metrics": MetricsModule,
    "lbfgs": LbfgsModule,
    "sigterm": SlowModule,
    "long": SlowModule,
}


class SaveOnException(callbacks.Callback):
    """Every rank writes its record when training stops on an exception (e.g. after SIGTERM)."""

    def on_exception(self, trainer, pl_module, exception):
        pl_module.record["exception"] = type(exception).__name__
        pl_module.record["global_step"] = trainer.global_step
        pl_module.record["at_exception"] = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        torch.save(pl_module.record, out / f"rank{trainer.global_rank}.pt")


pl.seed_everything(100 + rank_of_process())  # different initial weights per rank: rank 0's must win
model = MODULES[args.case]()
if args.convert_sync_bn:
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
(out / f"pid{rank_of_process()}").write_text(str(os.getpid()))
long = args.case in ("sigterm", "long")
strategy = args.strategy
if args.sync_every > 1:
    strategy = DDPAdasumStrategy(sync_every=args.sync_every, combine="mean", overlap_sync=args.overlap_sync)
trainer = pl.Trainer(
    strategy=strategy,
    accelerator="cpu",
    devices=args.devices,
    precision=args.precision,
    sync_batchnorm=args.sync_batchnorm,
    max_epochs=1000 if long else 1,
    limit_train_batches=None if long else args.steps,
    enable_progress_bar=False,
    enable_model_summary=False,
    logger=False,
    enable_checkpointing=args.case == "sigterm",  # OnExceptionCheckpoint is a ModelCheckpoint
    default_root_dir=str(out),
    callbacks=[SaveOnException()]
    + ([callbacks.OnExceptionCheckpoint(dirpath=str(out / "ckpt"))] if args.case == "sigterm" else []),
)
model.record["start"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
if args.case == "metrics":
    trainer.validate(model)
else:
    trainer.fit(model)
model.record["end"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
model.record["global_step"] = trainer.global_step
model.record["world_size"] = trainer.world_size
torch.save(model.record, out / f"rank{trainer.global_rank}.pt")
