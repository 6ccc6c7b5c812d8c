"""A world that shrinks and grows (simulated): the study's MNIST recipe at 4 ranks, 4 → 2 → 4 between epochs.

Four runs per seed, all from the same initial weights and ``DistributedSampler`` seed
(:func:`benchmarks.simulate.simulate`):

- ``adasum``: Adasum at the base learning rate (lr × 1), the world changing by ``cfg["elastic_schedule"]``;
- ``average``: gradients averaged, lr × 4 (tuned for the first epoch's 4 ranks), kept when the world drops to
  2, as a job resumed at another world size keeps it;
- each of them uninterrupted at 4 ranks for the same number of epochs.

At a change, the simulation continues from the same parameters; new rank ``r`` takes old rank
``r mod W_old``'s optimizer and scheduler state (as the elastic resume does), and each rank reads its shard of
the new world.
The one-cycle schedule spans the steps each run takes (an epoch at 2 ranks has twice the steps of one at 4).
"""

from __future__ import annotations

import statistics

import pytorch_lightning as pl
from tqdm.auto import tqdm

from benchmarks.common import BenchNet, tensor_split
from benchmarks.simulate import simulate, steps_per_epoch

#: (run name, method, learning-rate factor, elastic?) in the order of the report's table.
RUNS = (
    ("adasum_elastic", "adasum", 1.0, True),
    ("adasum_4", "adasum", 1.0, False),
    ("average_elastic", "average", 4.0, True),
    ("average_4", "average", 4.0, False),
)


def run(cfg: dict, lr: float, root: str) -> dict:
    """Every run of :data:`RUNS` for each of ``cfg["elastic_seeds"]``; the final epoch's metrics per run and
    their mean and spread (population standard deviation, min, max) over the seeds."""
    train, val = tensor_split(root, train=True), tensor_split(root, train=False)
    schedule, batch = list(cfg["elastic_schedule"]), cfg["batch_size"]
    start = schedule[0]
    runs = []
    jobs = [(seed, *spec) for seed in cfg["elastic_seeds"] for spec in RUNS]
    for seed, name, method, factor, elastic in tqdm(jobs, desc="elastic study", unit="run"):
        sizes = schedule if elastic else [start] * len(schedule)
        pl.seed_everything(seed, verbose=False)
        total = sum(steps_per_epoch(len(train), w, batch) for w in sizes)
        module = BenchNet(lr=lr, total_steps=total)
        res = simulate(
            module,
            train,
            num_workers=sizes,
            batch_size=batch,
            method=method,
            lr_factor=factor,
            max_epochs=len(sizes),
            sampler_seed=seed,
            val_dataset=val,
            progress=False,
        )
        last = res.history[-1]
        tqdm.write(
            f"elastic study {name} seed {seed}: val_acc {[round(h['val_acc'], 4) for h in res.history]} "
            f"({last['wall_s']:.0f} s)"
        )
        runs.append(
            {
                "run": name,
                "method": method,
                "lr_factor": factor,
                "world_sizes": sizes,
                "seed": seed,
                "total_steps": total,
                "val_acc": last["val_acc"],
                "val_loss": last["val_loss"],
                "history": res.history,
                "diverged": res.diverged,
            }
        )
    summary = []
    for name, method, factor, _ in RUNS:
        mine = [r for r in runs if r["run"] == name]
        row = {"run": name, "method": method, "lr_factor": factor, "world_sizes": mine[0]["world_sizes"]}
        for key in ("val_acc", "val_loss"):
            values = [r[key] for r in mine]
            row[key] = {
                "mean": statistics.fmean(values),
                "std": statistics.pstdev(values),
                "min": min(values),
                "max": max(values),
                "values": values,
            }
        summary.append(row)
    return {"baseline_lr": lr, "runs": runs, "summary": summary}
