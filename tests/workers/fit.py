"""Worker: a short fit with one of the strategies; every rank saves what it saw to OUT_DIR/rank{r}.pt.

usage: python -m tests.workers.fit OUT_DIR [options]   (see the argparse options below)

Launch it with horovodrun (Horovod strategies), torchrun, or plainly with ``--devices N`` (ddp_adasum:
Lightning starts the other processes).
"""

import argparse
import functools
import os
from pathlib import Path

import torch

from tests.workers import cases
from tests.workers.lightning import DDPAdasumStrategy, HorovodAdasumStrategy, pl
from tests.workers.tiny import MODULES

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--strategy", default="horovod_adasum")
p.add_argument("--devices", type=int, default=1)
p.add_argument("--inf-rank", type=int, default=-1)
p.add_argument("--inf-step", type=int, default=-1)
p.add_argument("--fp16-scaler", action="store_true", help="16-mixed with a GradScaler on CPU")
p.add_argument("--model", default="tiny", choices=sorted(MODULES))
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--max-steps", type=int, default=-1)
p.add_argument("--lr", type=float, default=0.1)
p.add_argument("--momentum", type=float, default=0.5)
p.add_argument("--scheduler", default="none")
p.add_argument("--optimizer", default="sgd")
p.add_argument("--accumulate", type=int, default=1)
p.add_argument("--ckpt-path", default=None, help="a checkpoint, or a folder holding exactly one")
p.add_argument("--samples", type=int, default=64)  # not --n: horovodrun would take it
p.add_argument("--precision", default="32-true")
p.add_argument("--compression", default="none")
p.add_argument("--clip-value", type=float, default=None)
p.add_argument("--clip-algorithm", default=None)
p.add_argument("--loss-scale", type=float, default=1.0)
p.add_argument("--zero-loss-rank", type=int, default=-1)
p.add_argument("--kill-rank", type=int, default=-1)
p.add_argument("--kill-at-step", type=int, default=-1)
p.add_argument("--lr-find", action="store_true", help="Tuner.lr_find first, then fit with its suggestion")
p.add_argument("--sync-every", type=int, default=1, help="ddp_adasum: local SGD, steps between syncs")
p.add_argument("--outer-lr", type=float, default=0.0, help="> 0: an outer Nesterov SGD (momentum 0.9)")
p.add_argument("--overlap-sync", action="store_true", help="ddp_adasum: each exchange behind the next window")
args = p.parse_args(cases.argv())
out = Path(args.out)

# Different initial weights per rank: the strategy must broadcast rank 0's.
RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "HOROVOD_RANK", "RANK", "LOCAL_RANK")
pl.seed_everything(100 + int(next((os.environ[v] for v in RANK_VARIABLES if os.environ.get(v)), "0")))
model = MODULES[args.model](
    lr=args.lr,
    momentum=args.momentum,
    scheduler=args.scheduler,
    optimizer=args.optimizer,
    n=args.samples,
    loss_scale=args.loss_scale,
    zero_loss_rank=args.zero_loss_rank,
    kill_rank=args.kill_rank,
    kill_at_step=args.kill_at_step,
    inf_rank=args.inf_rank,
    inf_step=args.inf_step,
)
strategy = args.strategy


def fp16_plugin():
    # On CPU Lightning turns precision="16-mixed" into bf16-mixed; the plugin keeps fp16 and its GradScaler.
    return pl.plugins.precision.MixedPrecision(
        precision="16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu")
    )


if args.compression != "none":
    strategy = HorovodAdasumStrategy(compression=args.compression)
if args.sync_every > 1 or args.outer_lr:
    outer = functools.partial(torch.optim.SGD, lr=args.outer_lr, momentum=0.9, nesterov=True)
    strategy = DDPAdasumStrategy(sync_every=args.sync_every, outer_optimizer=outer if args.outer_lr else None,
                                 overlap_sync=args.overlap_sync)  # fmt: skip
trainer = pl.Trainer(
    strategy=strategy,
    accelerator="cpu",
    devices=args.devices,
    precision=None if args.fp16_scaler else args.precision,
    plugins=[fp16_plugin()] if args.fp16_scaler else None,
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
suggestion = None
if args.lr_find:
    from importlib import import_module

    tuner = import_module(f"{pl.__name__}.tuner").Tuner(trainer)
    suggestion = tuner.lr_find(model, min_lr=1e-4, max_lr=1.0, num_training=20).suggestion()
ckpt_path = args.ckpt_path
if ckpt_path is not None and Path(ckpt_path).is_dir():
    (ckpt_path,) = Path(ckpt_path).rglob("*.ckpt")
trainer.fit(model, ckpt_path=ckpt_path)
record = model.record
record["lr_find_suggestion"] = suggestion
record["end"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
record["global_step"] = trainer.global_step
record["world_size"] = trainer.world_size
record["local_rank"] = trainer.local_rank
record["node_rank"] = trainer.node_rank
record["cluster_environment"] = type(trainer.strategy.cluster_environment).__name__
record["end_opt_state"] = {
    k: {n: t.clone() for n, t in s.items() if torch.is_tensor(t)}
    for k, s in trainer.optimizers[0].state_dict()["state"].items()
}
torch.save(record, out / f"rank{trainer.global_rank}.pt")
