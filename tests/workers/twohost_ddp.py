"""Worker: a tiny model under a torch.distributed strategy started by ``torchrun``; every rank saves
what it saw to ``OUT_DIR/rank{r}.pt``.

usage: python -m tests.workers.twohost_ddp OUT_DIR [--strategy NAME] [--epochs N] [--pg-timeout S]
    [--max-steps N --checkpoint-every K [--step-seconds T]] [--sync-every H] [--state-dict-type sharded]

``--strategy`` is a name from Lightning's strategy registry (``ddp_adasum``, or e.g. Lightning's ``ddp``).
``--pg-timeout S`` builds the strategy with ``timeout=timedelta(seconds=S)`` (the process group's
timeout: how long a collective waits for a lost peer); ``--sync-every H`` with ``sync_every=H``;
``--state-dict-type`` with ``state_dict_type=`` (``fsdp_adasum``). The
Trainer gets ``accelerator="cpu", devices=LOCAL_WORLD_SIZE, num_nodes=WORLD_SIZE // LOCAL_WORLD_SIZE``
from torchrun's variables.
Each rank writes its latest global step to ``OUT_DIR/step-rank{r}`` after every batch.

``--max-steps N --checkpoint-every K`` is the elastic recipe: ``ModelCheckpoint(OUT_DIR/checkpoints,
every_n_train_steps=K, save_last=True)`` and ``fit(ckpt_path="last")`` up to ``max_steps=N`` (epochs without
end); each rank also appends ``pid global_step time`` to ``OUT_DIR/progress-rank{r}`` after every batch, and
``--step-seconds T`` makes every batch last at least T seconds (a step that a link cut can fall inside).
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies import StrategyRegistry
from torch.distributed.tensor import DTensor

import adasum_lightning  # noqa: F401  (registers this project's strategies)
from tests.workers.tiny import TinyModule


class Progress(pl.Callback):
    def __init__(self, out: Path, step_seconds: float = 0.0, log: bool = False) -> None:
        self.out, self.step_seconds, self.log = out, step_seconds, log

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.started = time.monotonic()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        time.sleep(max(0.0, self.step_seconds - (time.monotonic() - self.started)))
        path = self.out / f"step-rank{trainer.global_rank}"
        path.with_suffix(".tmp").write_text(str(trainer.global_step))
        os.replace(path.with_suffix(".tmp"), path)
        if self.log:
            with (self.out / f"progress-rank{trainer.global_rank}").open("a") as f:
                f.write(f"{os.getpid()} {trainer.global_step} {time.time():.3f}\n")


def build_strategy(name: str, pg_timeout: float | None, **options: Any):
    options = {k: v for k, v in options.items() if v is not None}
    if pg_timeout is None and not options:
        return name
    entry = StrategyRegistry[name]
    params = {**entry["init_params"], **options}
    if pg_timeout is not None:
        params["timeout"] = datetime.timedelta(seconds=pg_timeout)
    return entry["strategy"](**params)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--strategy", default="ddp_adasum")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--pg-timeout", type=float, default=None)
    p.add_argument("--max-steps", type=int, default=-1)
    p.add_argument("--checkpoint-every", type=int, default=None)
    p.add_argument("--step-seconds", type=float, default=0.0)
    p.add_argument("--sync-every", type=int, default=None)
    p.add_argument("--state-dict-type", default=None)
    args = p.parse_args()
    elastic = args.checkpoint_every is not None
    out = Path(args.out)
    torch.set_num_threads(1)
    local_size = int(os.environ["LOCAL_WORLD_SIZE"])
    # One global seed (Lightning's DistributedSampler shuffles with each rank's PL_GLOBAL_SEED: per-rank
    # seeds would give overlapping shards), but different initial weights per rank: DDP must broadcast.
    pl.seed_everything(100)
    torch.manual_seed(1000 + int(os.environ["RANK"]))
    model = TinyModule(n=args.samples)
    trainer = pl.Trainer(
        strategy=build_strategy(
            args.strategy, args.pg_timeout, sync_every=args.sync_every, state_dict_type=args.state_dict_type
        ),
        accelerator="cpu",
        devices=local_size,
        num_nodes=int(os.environ["WORLD_SIZE"]) // local_size,
        max_epochs=-1 if elastic else args.epochs,
        max_steps=args.max_steps,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=elastic,
        callbacks=[
            Progress(out, args.step_seconds, log=elastic),
            *(
                [
                    ModelCheckpoint(
                        out / "checkpoints", every_n_train_steps=args.checkpoint_every, save_last=True
                    )
                ]
                if elastic
                else []
            ),
        ],
    )
    trainer.fit(model, ckpt_path="last" if elastic else None)
    record = {
        "host": socket.gethostname(),
        "env": {
            k: os.environ.get(k)
            for k in (
                "RANK",
                "LOCAL_RANK",
                "GROUP_RANK",
                "LOCAL_WORLD_SIZE",
                "WORLD_SIZE",
                "MASTER_ADDR",
                "ROLE_RANK",
            )
        },  # fmt: skip
        "dist": {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "backend": dist.get_backend()},
        "trainer": {
            "global_rank": trainer.global_rank,
            "local_rank": trainer.local_rank,
            "node_rank": trainer.node_rank,
            "world_size": trainer.world_size,
            "num_nodes": trainer.num_nodes,
            "num_devices": trainer.num_devices,
            "global_step": trainer.global_step,
        },
        "strategy": type(trainer.strategy).__name__,
        "environment": type(trainer.strategy.cluster_environment).__name__,
        "indices": model.record["indices"],
        "start": {
            k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in model.record["start"].items()
        },
        "params": {  # whole tensors (a collective over the shard group under fsdp_adasum)
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()
        },
    }
    torch.save(record, out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
