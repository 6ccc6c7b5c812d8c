"""Worker (torchrun): ``ddp_adasum`` with ``overlap_backward=True`` against the whole step, in one job.

usage: torchrun --nproc-per-node N -m tests.workers.overlap OUT {sgd,adam} ACCUMULATE

Five fits of :class:`tests.workers.tiny.FrozenBranchModule` (a frozen layer, a branch some ranks and steps
do not use) from the same initial weights and data: the whole step; bucket by bucket during backward, in
buckets of at most 100 bytes (three; the unused branch is one, completed at the step's end when unused);
bucket by bucket asked for with gradient clipping (by a norm no gradient reaches), which must fall back to
the whole step; and the whole step and bucket by bucket with a callback halving the gradients in
``on_after_backward`` (the second must fall back too). OUT/rank{r}.pt holds each fit's end state and the
buckets the overlap fits stepped.
"""

import os
from pathlib import Path

import torch

from adasum_lightning.trainer import DDPAdasumStrategy
from tests.workers import cases
from tests.workers.lightning import pl
from tests.workers.tiny import FrozenBranchModule

argv = cases.argv()
out, optimizer, accumulate = Path(argv[0]), argv[1], int(argv[2])
rank = int(os.environ["RANK"])


class HalveGradients(pl.Callback):
    """Changes the gradients between backward and the step: ``overlap_backward`` must take the whole step."""

    def on_after_backward(self, trainer, pl_module):
        for p in pl_module.parameters():
            if p.grad is not None:
                p.grad.mul_(0.5)


class BucketCount(pl.Callback):
    """The buckets of each optimizer's bucket-by-bucket step (None: the whole step), before teardown."""

    def on_train_end(self, trainer, pl_module):
        built = trainer.strategy._backward_steps.values()
        self.buckets = [None if b is None else len(b.buckets) for b in built]


def fit(overlap: bool, clip: float | None = None, halve: bool = False) -> tuple[dict, list, int, dict]:
    pl.seed_everything(100 + rank)  # different weights per rank: the strategy broadcasts rank 0's
    model = FrozenBranchModule(optimizer=optimizer, momentum=0.9, lr=0.05)
    counter = BucketCount()
    trainer = pl.Trainer(
        strategy=DDPAdasumStrategy(overlap_backward=overlap, bucket_cap_mb=100 / 2**20),
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        max_epochs=2,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        callbacks=[counter, HalveGradients()] if halve else [counter],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
    )
    trainer.fit(model)
    end = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return end, counter.buckets, trainer.global_step, model.record["start"]


whole, _, steps, start = fit(overlap=False)
overlap, buckets, overlap_steps, _ = fit(overlap=True)
fallback, fallback_buckets, _, _ = fit(overlap=True, clip=1e9)
halved, _, _, _ = fit(overlap=False, halve=True)
halved_overlap, halved_buckets, _, _ = fit(overlap=True, halve=True)
torch.save(
    {
        "start": start,
        "whole": whole,
        "overlap": overlap,
        "fallback": fallback,
        "buckets": buckets,
        "fallback_buckets": fallback_buckets,
        "halved": halved,
        "halved_overlap": halved_overlap,
        "halved_buckets": halved_buckets,
        "steps": (steps, overlap_steps),
    },
    out / f"rank{rank}.pt",
)
