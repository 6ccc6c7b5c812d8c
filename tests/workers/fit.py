"""Worker: a short fit with a horovod strategy; every rank saves what it saw to OUT_DIR/rank{r}.pt.

usage: fit.py OUT_DIR [options]   (see the argparse options below)
"""

import argparse
import os
from pathlib import Path

import horovod.torch as hvd
import pytorch_lightning as pl
import torch

import adasum_lightning
from tests.workers.tiny import MODULES

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--strategy", default="horovod_adasum")
p.add_argument("--model", default="tiny", choices=sorted(MODULES))
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--max-steps", type=int, default=-1)
p.add_argument("--lr", type=float, default=0.1)
p.add_argument("--scheduler", default="none")
p.add_argument("--optimizer", default="sgd")
p.add_argument("--accumulate", type=int, default=1)
p.add_argument("--ckpt-path", default=None)
p.add_argument("--samples", type=int, default=64)  # not --n: horovodrun would take it
p.add_argument("--precision", default="32-true")
p.add_argument("--compression", default="none")
p.add_argument("--clip-value", type=float, default=None)
p.add_argument("--clip-algorithm", default=None)
p.add_argument("--loss-scale", type=float, default=1.0)
p.add_argument("--zero-loss-rank", type=int, default=-1)
p.add_argument("--kill-rank", type=int, default=-1)
p.add_argument("--kill-at-step", type=int, default=-1)
args = p.parse_args()
out = Path(args.out)

# Different initial weights per rank: the strategy must broadcast rank 0's.
pl.seed_everything(100 + int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("HOROVOD_RANK", "0"))))
model = MODULES[args.model](
    lr=args.lr,
    scheduler=args.scheduler,
    optimizer=args.optimizer,
    n=args.samples,
    loss_scale=args.loss_scale,
    zero_loss_rank=args.zero_loss_rank,
    kill_rank=args.kill_rank,
    kill_at_step=args.kill_at_step,
)
strategy = args.strategy
if args.compression != "none":
    strategy = adasum_lightning.HorovodAdasumStrategy(compression=args.compression)
trainer = pl.Trainer(
    strategy=strategy,
    accelerator="cpu",
    devices=1,
    precision=args.precision,
    gradient_clip_val=args.clip_value,
    gradient_clip_algorithm=args.clip_algorithm,
    max_epochs=args.epochs,
    max_steps=args.max_steps,
    accumulate_grad_batches=args.accumulate,
    enable_progress_bar=False,
    enable_model_summary=False,
    logger=False,
    default_root_dir=str(out),
    enable_checkpointing=True,
)
trainer.fit(model, ckpt_path=args.ckpt_path)
record = model.record
record["end"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
record["global_step"] = trainer.global_step
record["world_size"] = hvd.size()
record["end_opt_state"] = {
    k: {n: t.clone() for n, t in s.items() if torch.is_tensor(t)}
    for k, s in trainer.optimizers[0].state_dict()["state"].items()
}
torch.save(record, out / f"rank{hvd.rank()}.pt")
