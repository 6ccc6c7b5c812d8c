"""Worker: a short fit with a horovod strategy; every rank saves what it saw.

usage: fit.py OUT_DIR [--strategy NAME] [--epochs E] [--max-steps S] [--lr LR]
              [--scheduler none|step|onecycle] [--optimizer sgd|adam] [--accumulate K]
              [--ckpt-path PATH] [--n N]
"""

import argparse
from pathlib import Path

import horovod.torch as hvd
import pytorch_lightning as pl
import torch
from tiny import TinyModule

import adasum_lightning  # noqa: F401

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--strategy", default="horovod_adasum")
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--max-steps", type=int, default=-1)
p.add_argument("--lr", type=float, default=0.1)
p.add_argument("--scheduler", default="none")
p.add_argument("--optimizer", default="sgd")
p.add_argument("--accumulate", type=int, default=1)
p.add_argument("--ckpt-path", default=None)
p.add_argument("--n", type=int, default=64)
args = p.parse_args()
out = Path(args.out)

rank_env = int(__import__("os").environ.get("OMPI_COMM_WORLD_RANK", "0"))
pl.seed_everything(100 + rank_env)  # different initial weights per rank: the strategy must broadcast rank 0's
model = TinyModule(lr=args.lr, scheduler=args.scheduler, optimizer=args.optimizer, n=args.n)
trainer = pl.Trainer(
    strategy=args.strategy,
    accelerator="cpu",
    devices=1,
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
