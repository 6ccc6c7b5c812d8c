"""Training throughput: Lightning + ``horovod_adasum`` vs a raw Horovod loop (the seed script's logic), and
Lightning + ``ddp_adasum`` vs Lightning + ``horovod_adasum``.

Same model (the example's :class:`MNISTNet`), batch (64 per process), data (the example's
:class:`MNISTDataModule`: torchvision MNIST, per-image ``ToTensor`` + ``Normalize``, a
``DistributedSampler`` shard per rank, the same shuffling seed) and optimizer (SGD lr 0.01, momentum 0.5).
``raw``: the seed's loop with ``hvd.DistributedOptimizer(op=hvd.Adasum)``; ``lightning``:
``Trainer(strategy="horovod_adasum")`` (both under ``horovodrun -np N``); ``ddp_adasum``:
``Trainer(strategy="ddp_adasum", devices=N)`` started as one plain process, Lightning starting the other
N − 1. One epoch; rank 0 times the steps from batch ``--skip`` (fetched) to the end of the last step and
writes steps/s to a JSON file, with every rank's CPU time over the same steps (``time.process_time``: all
threads of the process, Horovod's background thread included) per step.

``lightning_no_sigterm_broadcast``: ``lightning`` without Lightning's per-step SIGTERM broadcast (a
diagnostic of that broadcast's cost).

usage: python -m benchmarks.throughput OUT.json --impl IMPL [--skip K] [--seed S]  (under horovodrun)
       python -m benchmarks.throughput OUT.json --impl ddp_adasum --devices N [--skip K] [--seed S]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from benchmarks.common import MNISTDataModule, MNISTNet, data_dir

BATCH, LR, MOMENTUM = 64, 0.01, 0.5


def raw_loop(skip: int, seed: int) -> tuple[int, float, float]:
    """The seed's Horovod MNIST training loop, one epoch: returns (timed steps, seconds, CPU seconds)."""
    hvd.init()
    torch.manual_seed(seed)
    data = MNISTDataModule(data_dir=data_dir(), batch_size=BATCH)
    if hvd.local_rank() == 0:
        data.prepare_data()
    hvd.barrier()
    data.setup("fit")
    sampler = DistributedSampler(data.train_set, num_replicas=hvd.size(), rank=hvd.rank(), seed=seed)
    sampler.set_epoch(0)
    loader = DataLoader(data.train_set, batch_size=BATCH, sampler=sampler)
    model = MNISTNet(lr=LR, momentum=MOMENTUM)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), op=hvd.Adasum)
    model.train()
    start, steps = None, 0
    for i, (x, y) in enumerate(loader):
        if i == skip:
            start, cpu = time.perf_counter(), time.process_time()
        optimizer.zero_grad()
        loss = F.nll_loss(model(x), y)
        loss.backward()
        optimizer.step()
        if start is not None:
            steps += 1
    return steps, time.perf_counter() - start, time.process_time() - cpu


def lightning_loop(
    skip: int, seed: int, strategy: str = "horovod_adasum", devices: int = 1
) -> tuple[int, float, float]:
    """The same epoch through ``Trainer(strategy=strategy, devices=devices)``: (timed steps, seconds, CPU
    seconds)."""
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import Callback

    import adasum_lightning  # noqa: F401

    class Timer(Callback):
        start, end, steps, cpu_start, cpu_end = None, None, 0, 0.0, 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == skip:
                Timer.start, Timer.cpu_start = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if Timer.start is not None:
                Timer.steps += 1
                Timer.end, Timer.cpu_end = time.perf_counter(), time.process_time()

    pl.seed_everything(seed, verbose=False)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_epochs=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Timer()],
    )
    trainer.fit(MNISTNet(lr=LR, momentum=MOMENTUM), MNISTDataModule(data_dir=data_dir(), batch_size=BATCH))
    return Timer.steps, Timer.end - Timer.start, Timer.cpu_end - Timer.cpu_start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument(
        "--impl", choices=["raw", "lightning", "lightning_no_sigterm_broadcast", "ddp_adasum"], required=True
    )
    p.add_argument("--devices", type=int, default=1, help="ddp_adasum: processes Lightning runs")
    p.add_argument("--skip", type=int, default=10, help="untimed warm-up steps")
    p.add_argument("--seed", type=int, default=42)
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.impl == "raw":
        steps, seconds, cpu = raw_loop(args.skip, args.seed)
    elif args.impl == "lightning":
        steps, seconds, cpu = lightning_loop(args.skip, args.seed)
    elif args.impl == "lightning_no_sigterm_broadcast":
        # Diagnostic only: Lightning (>= 2.5) broadcasts rank 0's SIGTERM flag over torch.distributed before
        # every training step, which is how every rank stops at the same step after a SIGTERM; this variant
        # skips that broadcast to measure its cost (a job run like this would not stop cleanly on SIGTERM).
        from pytorch_lightning.loops.training_epoch_loop import _TrainingEpochLoop

        _TrainingEpochLoop._broadcast_sigterm_tensor = lambda self: None
        steps, seconds, cpu = lightning_loop(args.skip, args.seed)
    else:
        steps, seconds, cpu = lightning_loop(args.skip, args.seed, "ddp_adasum", args.devices)
    if args.impl == "ddp_adasum":
        import torch.distributed as dist

        rank, size = dist.get_rank(), dist.get_world_size()
        per_rank = [None] * size
        dist.all_gather_object(per_rank, (steps, seconds, cpu))
    else:
        rank, size = hvd.rank(), hvd.size()
        per_rank = hvd.allgather_object((steps, seconds, cpu))
    if rank == 0:
        result = {
            "impl": args.impl,
            "strategy": None
            if args.impl == "raw"
            else "horovod_adasum"
            if "lightning" in args.impl
            else args.impl,
            "launcher": "lightning" if args.impl == "ddp_adasum" else "horovodrun",
            "world_size": size,
            "steps": steps,
            "seconds": seconds,
            "steps_per_s": steps / seconds,
            "per_rank": per_rank,
            "cpu_ms_per_step_per_rank": [1e3 * c / n for n, _, c in per_rank],
            "batch_size": BATCH,
        }
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
