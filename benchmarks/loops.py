"""Steps/s of the same training in each form: plain torch loops, Fabric and the Trainer, Adasum and DDP.

``--impl``:

- ``plain_ddp``: a plain loop with ``DistributedDataParallel`` (the anchor of DDP users), under torchrun;
- ``plain_adasum``: a plain loop with :class:`adasum_lightning.AdasumOptimizer`, under torchrun;
- ``plain_adasum_backward``: a plain loop stepping and reducing bucket by bucket during backward
  (:class:`adasum_lightning.step.BackwardAdasumStep`), under torchrun;
- ``plain_local``: the plain loop's local steps alone, no reduction (the compute every form pays, with both
  processes running: what the reductions add is measured against it), under torchrun;
- ``fabric_adasum``: ``Fabric(strategy="ddp_adasum", devices=N)``, ``fabric.launch()``;
- ``trainer_ddp``: ``Trainer(strategy="ddp", devices=N)`` (Lightning's launcher);
- ``trainer_adasum``: ``Trainer(strategy="ddp_adasum", devices=N)`` (Lightning's launcher);
- ``trainer_adasum_overlap``: ``Trainer(strategy=DDPAdasumStrategy(overlap_backward=True))``: bucket by
  bucket during backward;
- ``trainer_adasum_sync10``: ``Trainer(strategy=DDPAdasumStrategy(sync_every=10))``: local SGD, the Adasum
  of the pseudo-gradients every 10 steps;
- ``trainer_horovod_adasum``: ``Trainer(strategy="horovod_adasum")`` under ``horovodrun -np N`` (Horovod's
  Adasum optimizer, which steps and reduces parameter by parameter during backward; no reduction time);
- ``trainer_adasum_iterable``: the same with an ``IterableDataset`` (equal shards): the uneven-inputs
  agreement then costs one small all_reduce per step (:mod:`adasum_lightning.uneven`).

``--model``: ``cnn`` (the example's CNN, :class:`examples.mnist_torch.MNISTCNN`, 21.8k parameters) or
``mlp`` (784 → 4 × 2048 → 10, ReLU, 14.2 M parameters, 57 MB float32). Synthetic data held in memory
(MNIST-shaped, batch 64 per process, a ``DistributedSampler`` shard per rank), SGD lr 0.01 momentum 0.9, one
intra-op thread per process, Gloo. Rank 0 times the steps from step ``--skip`` to the end; every rank's peak
RSS and (Adasum forms) the time spent in ``adasum_allreduce`` per step are gathered (bucket by bucket
during backward: the time left to wait for the reductions after backward).

usage: torchrun --nproc-per-node N -m benchmarks.loops OUT.json --impl plain_ddp|plain_adasum --model M
       python -m benchmarks.loops OUT.json --impl fabric_adasum|trainer_ddp|trainer_adasum --devices N ...
       horovodrun -np N python -m benchmarks.loops OUT.json --impl trainer_horovod_adasum --model M
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

import adasum_lightning.local_sgd
import adasum_lightning.step
from adasum_lightning.step import BackwardAdasumStep
from examples.mnist_torch import MNISTCNN

BATCH, LR, MOMENTUM = 64, 0.01, 0.9
IMPLS = (
    "plain_ddp",
    "plain_adasum",
    "plain_adasum_backward",
    "plain_local",
    "fabric_adasum",
    "trainer_ddp",
    "trainer_adasum",
    "trainer_adasum_overlap",
    "trainer_adasum_sync10",
    "trainer_horovod_adasum",
    "trainer_adasum_iterable",
)


def make_model(name: str, hidden: int = 2048) -> nn.Module:
    """``cnn`` or ``mlp`` (784 → 4 × ``hidden`` → 10, ReLU, log-softmax)."""
    if name == "cnn":
        return MNISTCNN()
    layers, width = [nn.Flatten()], 784
    for _ in range(4):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    return nn.Sequential(*layers, nn.Linear(width, 10), nn.LogSoftmax(dim=1))


def synthetic_data(steps: int, world_size: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    n = steps * BATCH * world_size
    return TensorDataset(torch.randn(n, 1, 28, 28, generator=gen), torch.randint(0, 10, (n,), generator=gen))


class Shard(IterableDataset):
    """Rank ``rank``'s samples of ``data`` (every ``world_size``-th), without a length."""

    def __init__(self, data: TensorDataset, rank: int, world_size: int) -> None:
        self.data, self.rank, self.world_size = data, rank, world_size

    def __iter__(self):
        for i in range(self.rank, len(self.data), self.world_size):
            yield self.data[i]


class ReductionTimer:
    """Adds up the wall time (seconds, while ``on``) the main thread spends in the Adasum allreduce of the
    whole step (``adasum_allreduce_flat``) or waiting for the reductions after backward
    (``BackwardAdasumStep.finish``; its worker thread's reductions overlap backward and are not counted)."""

    def __init__(self) -> None:
        self.seconds, self.on = 0.0, False
        #: Bytes handed to the Adasum allreduce while ``on`` (each rank sends about as many).
        self.bytes = 0
        self._wrap(adasum_lightning.step, "adasum_allreduce_flat")
        self._wrap(adasum_lightning.local_sgd, "adasum_allreduce_flat")
        self._wrap(BackwardAdasumStep, "finish")

    def _wrap(self, owner: object, name: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            if self.on and args and isinstance(args[0], torch.Tensor):
                self.bytes += args[0].numel() * args[0].element_size()
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if self.on and threading.current_thread() is threading.main_thread():
                    self.seconds += time.perf_counter() - start

        setattr(owner, name, timed)


class StepClock:
    """Rank 0's clock over steps ``skip`` … end: wall seconds, CPU seconds, reduction seconds."""

    def __init__(self, skip: int, reduction: ReductionTimer) -> None:
        self.skip, self.reduction, self.steps = skip, reduction, 0
        self.start = self.cpu_start = self.end = self.cpu_end = 0.0

    def before_step(self, i: int) -> None:
        if i == self.skip:
            self.start, self.cpu_start, self.reduction.on = time.perf_counter(), time.process_time(), True

    def after_step(self, i: int) -> None:
        if i >= self.skip:
            self.steps += 1
            self.end, self.cpu_end = time.perf_counter(), time.process_time()


def plain_loop(impl: str, model_name: str, steps: int, clock: StepClock) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = make_model(model_name)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    backward_step = None
    if impl == "plain_ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif impl == "plain_adasum":
        optimizer = adasum_lightning.AdasumOptimizer(optimizer)
    elif impl == "plain_adasum_backward":
        backward_step = BackwardAdasumStep(optimizer, dist.new_group(backend="gloo"))
    data = synthetic_data(steps, world)
    sampler = DistributedSampler(data, world, rank, shuffle=True, seed=0)
    for i, (x, y) in enumerate(DataLoader(data, batch_size=BATCH, sampler=sampler)):
        clock.before_step(i)
        optimizer.zero_grad()
        F.nll_loss(model(x), y).backward()
        if backward_step is not None:
            backward_step.finish()
        else:
            optimizer.step()
        clock.after_step(i)


def fabric_loop(model_name: str, steps: int, devices: int, clock: StepClock) -> None:
    from lightning_fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=devices, strategy="ddp_adasum")
    fabric.launch()
    fabric.seed_everything(0, verbose=False)
    model = make_model(model_name)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM))
    loader = fabric.setup_dataloaders(
        DataLoader(synthetic_data(steps, devices), batch_size=BATCH, shuffle=True)
    )
    for i, (x, y) in enumerate(loader):
        clock.before_step(i)
        optimizer.zero_grad()
        fabric.backward(F.nll_loss(model(x), y))
        optimizer.step()
        clock.after_step(i)


def trainer_loop(impl: str, model_name: str, steps: int, devices: int, clock: StepClock) -> None:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import Callback

    horovod = impl == "trainer_horovod_adasum"  # horovodrun starts a process per rank, each with one device
    world = int(os.environ["OMPI_COMM_WORLD_SIZE"]) if horovod else devices

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = make_model(model_name)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.nll_loss(self.model(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)

        def train_dataloader(self):
            data = synthetic_data(steps, world)
            if impl == "trainer_adasum_iterable":
                return DataLoader(Shard(data, self.global_rank, world), batch_size=BATCH)
            return DataLoader(data, batch_size=BATCH, shuffle=True)

    class Clock(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            clock.before_step(batch_idx)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            clock.after_step(batch_idx)

    from adasum_lightning.trainer import DDPAdasumStrategy

    strategy = {
        "trainer_ddp": "ddp",
        "trainer_adasum_overlap": DDPAdasumStrategy(overlap_backward=True),
        "trainer_adasum_sync10": DDPAdasumStrategy(sync_every=10),
        "trainer_horovod_adasum": "horovod_adasum",
    }
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        strategy=strategy.get(impl, "ddp_adasum"),
        use_distributed_sampler=impl != "trainer_adasum_iterable",
        accelerator="cpu",
        devices=1 if horovod else devices,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Clock()],
    )
    torch.manual_seed(0)
    trainer.fit(Module())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--impl", choices=IMPLS, required=True)
    p.add_argument("--model", choices=("cnn", "mlp"), default="cnn")
    p.add_argument("--devices", type=int, default=2, help="processes (Fabric and Trainer forms)")
    p.add_argument("--steps", type=int, default=200, help="steps per process, warm-up included")
    p.add_argument("--skip", type=int, default=5, help="untimed warm-up steps")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import adasum_lightning  # noqa: F401  (registers ddp_adasum)

    reduction = ReductionTimer()
    clock = StepClock(args.skip, reduction)
    if args.impl.startswith("plain"):
        plain_loop(args.impl, args.model, args.steps, clock)
    elif args.impl == "fabric_adasum":
        fabric_loop(args.model, args.steps, args.devices, clock)
    else:
        trainer_loop(args.impl, args.model, args.steps, args.devices, clock)
    rank, size = dist.get_rank(), dist.get_world_size()
    mine = {
        "seconds": clock.end - clock.start,
        "cpu_seconds": clock.cpu_end - clock.cpu_start,
        "reduction_seconds": reduction.seconds,
        "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }
    per_rank = [None] * size
    dist.all_gather_object(per_rank, mine)
    if rank == 0:
        result = {
            "impl": args.impl,
            "model": args.model,
            "parameters": sum(p.numel() for p in make_model(args.model).parameters()),
            "world_size": size,
            "steps": clock.steps,
            "seconds": mine["seconds"],
            "steps_per_s": clock.steps / mine["seconds"],
            "reduction_ms_per_step": 1e3 * mine["reduction_seconds"] / clock.steps,
            "reduced_bytes_per_sample": reduction.bytes / (clock.steps * BATCH),
            "cpu_ms_per_step_per_rank": [1e3 * r["cpu_seconds"] / clock.steps for r in per_rank],
            "peak_rss_mb_per_rank": [r["peak_rss_kb"] / 1024 for r in per_rank],
            "batch_size": BATCH,
        }
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
