"""Worker: a fit whose ranks have different numbers of batches; every rank saves OUT/rank{r}.pt.

usage: python -m tests.workers.uneven OUT --strategy S [--devices N] [--loader sized|iterable]
       [--uneven truncate|error] [--validate]

Rank r has 4 + r training batches of 4 samples (its own slice of ``IndexedData``, no DistributedSampler),
either as a sized ``DataLoader`` or as an ``IterableDataset``. With ``--validate`` rank r also has 2 + r
validation batches, and the module logs the epoch-level ``sync_dist`` sum of their first features.
"""

import argparse
import os
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, Subset

from tests.workers import cases
from tests.workers.lightning import pl
from tests.workers.samples import IndexedData, tiny_net

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--strategy", default="ddp_adasum")
p.add_argument("--devices", type=int, default=1)
p.add_argument("--loader", default="sized", choices=("sized", "iterable"))
p.add_argument("--uneven", default=None, choices=("truncate", "error"))
p.add_argument("--validate", action="store_true")
args = p.parse_args(cases.argv())
out = Path(args.out)

DATA = IndexedData(128)


class Batches(IterableDataset):
    """``count`` batches of 4 consecutive samples from ``start``, without a length."""

    def __init__(self, start: int, count: int) -> None:
        self.start, self.count = start, count

    def __iter__(self):
        for b in range(self.count):
            i = self.start + 4 * b
            yield DATA.x[i : i + 4], DATA.y[i : i + 4]


def loader(start: int, count: int):
    if args.loader == "iterable":
        return DataLoader(Batches(start, count), batch_size=None)
    return DataLoader(Subset(DATA, range(start, start + 4 * count)), batch_size=4, shuffle=False)


class Uneven(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_net()
        self.seen: list[int] = []
        self.val_sums: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch[0], batch[1]
        if batch_idx == 0:
            self.seen.append(0)
        self.seen[-1] += 1
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x = batch[0]
        self.log("val_sum", x[:, 0].sum(), sync_dist=True, reduce_fx="sum", on_epoch=True, batch_size=len(x))

    def on_validation_epoch_end(self):
        if not self.trainer.sanity_checking:
            self.val_sums.append(float(self.trainer.callback_metrics["val_sum"]))

    def train_dataloader(self):
        r = self.global_rank
        return loader(32 * r, 4 + r)

    def val_dataloader(self):
        r = self.global_rank
        return loader(96 + 12 * r, 2 + r)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.5)


RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "HOROVOD_RANK", "RANK", "LOCAL_RANK")
pl.seed_everything(100 + int(next((os.environ[v] for v in RANK_VARIABLES if os.environ.get(v)), "0")))
model = Uneven()
strategy = args.strategy
if args.uneven is not None:
    from tests.workers.lightning import adasum_strategies

    classes = {
        "ddp_adasum": "DDPAdasumStrategy",
        "horovod_adasum": "HorovodAdasumStrategy",
        "horovod": "HorovodStrategy",
    }
    strategy = getattr(adasum_strategies, classes[args.strategy])(uneven_inputs=args.uneven)
trainer = pl.Trainer(
    strategy=strategy,
    accelerator="cpu",
    devices=args.devices,
    max_epochs=2,
    use_distributed_sampler=False,
    num_sanity_val_steps=0,
    limit_val_batches=1.0 if args.validate else 0,
    enable_progress_bar=False,
    enable_model_summary=False,
    logger=False,
    enable_checkpointing=False,
)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        trainer.fit(model)
        error = None
    except Exception as err:  # the uneven_inputs="error" case: recorded, then re-raised
        error = f"{type(err).__name__}: {err}"
rank = trainer.global_rank
torch.save(
    {
        "seen": model.seen,
        "val_sums": model.val_sums,
        "end": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "warnings": [str(w.message) for w in caught if "different numbers" in str(w.message)],
        "error": error,
        "global_step": trainer.global_step,
    },
    out / f"rank{rank}.pt",
)
if error is not None:
    raise SystemExit(1)
