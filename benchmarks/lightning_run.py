"""One real training run of the study: Lightning + an Adasum or averaging strategy on MNIST.

``horovod_adasum`` / ``horovod``: run under ``horovodrun -np N`` (or plainly: a world of size 1).
``ddp_adasum``: run as one plain process with ``--devices N``; Lightning starts the other N − 1.
Rank 0 writes a JSON file with the per-epoch validation accuracy, the steps, the wall time and every
rank's peak RSS; with ``--target`` all ranks stop after the first epoch whose (all-rank) validation
accuracy reaches it; a diverged run (validation loss not finite or accuracy < 50% after an epoch) stops too.

usage: python -m benchmarks.lightning_run OUT.json --strategy horovod_adasum|horovod|ddp_adasum --lr LR
           [--devices N (ddp_adasum)] [--lr-factor F] [--epochs E] [--batch-size B] [--seed S]
           [--target T] [--max-steps K] [--save-params PATH] [--schedule onecycle|constant] [--momentum M]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import time
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback

import adasum_lightning
from adasum_lightning.launch_environment import launcher_world_size
from benchmarks.common import BenchNet, TensorMNISTDataModule, data_dir, onecycle_steps

#: A run whose validation loss is not finite or whose accuracy is below this after an epoch is stopped as
#: diverged (chance is 0.1 on MNIST).
DIVERGED_ACC = 0.5


class Recorder(Callback):
    """Per-epoch validation accuracy, steps and wall time; stops the run once ``target`` is reached."""

    def __init__(self, target: float | None) -> None:
        self.target = target
        self.history: list[dict] = []
        self.start = time.perf_counter()
        self.train_s = 0.0
        self._epoch_start = 0.0

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._epoch_start = time.perf_counter()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.train_s += time.perf_counter() - self._epoch_start

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        acc = float(trainer.callback_metrics["val_acc"])
        self.history.append(
            {
                "epoch": trainer.current_epoch + 1,
                "step": trainer.global_step,
                "val_acc": acc,
                "val_loss": float(trainer.callback_metrics["val_loss"]),
                "wall_s": time.perf_counter() - self.start,
            }
        )
        # val_acc and val_loss are synchronised over the ranks, so every rank takes the same decision.
        if self.target is not None and acc >= self.target:
            trainer.should_stop = True
        if not math.isfinite(self.history[-1]["val_loss"]) or acc < DIVERGED_ACC:
            self.history[-1]["diverged"] = True
            trainer.should_stop = True


def _gather(value: object) -> list:
    """``value`` of every rank, in rank order, over the strategy's ``torch.distributed`` process group
    (all three strategies have one); ``[value]`` without one."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [value]
    values = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(values, value)
    return values


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument(
        "--strategy", default="horovod_adasum", choices=["horovod_adasum", "horovod", "ddp_adasum"]
    )
    p.add_argument("--devices", type=int, default=1, help="ddp_adasum: processes Lightning starts")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--lr-factor", type=float, default=1.0, help="learning-rate factor (lr_scaling)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--schedule", default="onecycle", choices=["onecycle", "constant"])
    p.add_argument("--epochs", type=int, default=4, help="epoch cap; also the one-cycle length")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", type=float, default=None)
    p.add_argument("--max-steps", type=int, default=-1)
    p.add_argument("--save-params", default=None)
    args = p.parse_args(argv)

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    horovod = args.strategy != "ddp_adasum"
    world = launcher_world_size() if horovod else args.devices
    pl.seed_everything(args.seed, verbose=False)
    model = BenchNet(
        lr=args.lr,
        momentum=args.momentum,
        schedule=args.schedule,
        total_steps=onecycle_steps(args.epochs, world, args.batch_size),
    )
    data = TensorMNISTDataModule(data_dir=data_dir(), batch_size=args.batch_size, eval_batch_size=1000)
    strategy_cls = {
        "horovod_adasum": adasum_lightning.HorovodAdasumStrategy,
        "horovod": adasum_lightning.HorovodStrategy,
        "ddp_adasum": adasum_lightning.DDPAdasumStrategy,
    }[args.strategy]
    strategy = strategy_cls(lr_scaling=args.lr_factor)
    recorder = Recorder(args.target)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1 if horovod else args.devices,
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[recorder],
        default_root_dir=str(Path(args.out).parent),
    )
    trainer.fit(model, data)

    # Horovod's Adasum optimizer keeps its copy of the parameters between steps; ddp_adasum's copy lives only
    # during the step (0 here).
    extra_copy_bytes = 0
    for optimizer in trainer.optimizers:
        for start in getattr(optimizer, "_starting_models", {}).values():
            extra_copy_bytes += start.numel() * start.element_size()
    rss = _gather(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    rank = trainer.global_rank
    if args.save_params and rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.save_params)
    if rank == 0:
        result = {
            "config": vars(args),
            "launcher": "horovodrun" if horovod else "lightning",
            "world_size": trainer.world_size,
            "lr_factor": strategy.lr_factor,
            "global_step": trainer.global_step,
            "history": recorder.history,
            "train_s": recorder.train_s,
            "peak_rss_kb_per_rank": rss,
            "adasum_start_copy_bytes": extra_copy_bytes,
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        }
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
