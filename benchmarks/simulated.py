"""Simulated workers on real MNIST (:mod:`benchmarks.simulate`): validation, then N = 8 … 64.

- Validation: real ``horovodrun`` jobs (N = 2 and 4, Adasum; N = 4, averaging) train the study's model
  for ``validation_steps`` steps; the simulator replays them from the same seed and data order; the
  largest parameter difference is recorded.
- Scaling: epochs (and steps) to the target for Adasum (lr × 1; × 2 on the first seed, the factor Horovod's
  Adasum guide suggests trying on CPU) and averaging (lr × √N; lr × N on the first seed) at each simulated
  N, with the study's baseline recipe and epoch cap.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytorch_lightning as pl
import torch
from tqdm.auto import tqdm

from benchmarks.common import BenchNet, command_line, horovodrun, logs_for, onecycle_steps, tensor_split
from benchmarks.simulate import simulate


def validate(cfg: dict, lr: float, root: str, out_dir: Path) -> list[dict]:
    """Real vs simulated parameters after ``cfg['validation_steps']`` steps; one record per case."""
    steps, batch, cap, seed = cfg["validation_steps"], cfg["batch_size"], cfg["epochs"], cfg["seeds"][0]
    train = tensor_split(root, train=True)
    records = []
    for np_, method in cfg["validation_cases"]:
        params = out_dir / "runs" / f"validation_n{np_}_{method}.pt"
        strategy = "horovod_adasum" if method == "adasum" else "horovod"
        factor = 1.0 if method == "adasum" else float(np_)
        args = [
            "benchmarks.lightning_run",
            str(params.with_suffix(".json")),
            "--strategy",
            strategy,
            "--lr",
            str(lr),
            "--lr-factor",
            str(factor),
            "--epochs",
            str(cap),
            "--batch-size",
            str(batch),
            "--seed",
            str(seed),
            "--max-steps",
            str(steps),
            "--save-params",
            str(params),
        ]
        wall = horovodrun(np_, args, log=logs_for(out_dir) / f"validation_n{np_}_{method}.log")
        real = torch.load(params, weights_only=False)
        pl.seed_everything(seed, verbose=False)
        module = BenchNet(lr=lr, total_steps=onecycle_steps(cap, np_, batch))
        start = time.perf_counter()
        simulate(
            module,
            train,
            num_workers=np_,
            batch_size=batch,
            method=method,
            max_epochs=cap,
            max_steps=steps,
            sampler_seed=seed,
            progress=False,
        )
        sim_s = time.perf_counter() - start
        diffs = {k: (v - real[k]).abs().max().item() for k, v in module.state_dict().items()}
        scale = max(v.abs().max().item() for v in real.values())
        records.append(
            {
                "np": np_,
                "method": method,
                "steps": steps,
                "seed": seed,
                "max_abs_diff": max(diffs.values()),
                "max_rel_diff": max(diffs.values()) / scale,
                "per_tensor_max_abs_diff": diffs,
                "real_job_wall_s": wall,
                "simulate_s": sim_s,
                "command": command_line(np_, args),
            }
        )
        params.unlink()
    return records


def scaling(cfg: dict, lr: float, root: str) -> list[dict]:
    """Simulated epochs-to-target per N and method (history per epoch for every run)."""
    train, val = tensor_split(root, train=True), tensor_split(root, train=False)
    batch, cap, target = cfg["batch_size"], cfg["sim_epochs"], cfg["target"]
    cases = []
    for n in cfg["sim_sizes"]:
        for seed in cfg["sim_seeds"]:
            cases.append((n, "adasum", "x1", 1.0, seed))
            if "x2" in cfg.get("sim_adasum_factors", []) and seed == cfg["sim_seeds"][0]:
                cases.append((n, "adasum", "x2", 2.0, seed))
            if "xsqrtN" in cfg["sim_average_factors"]:
                cases.append((n, "average", "xsqrtN", math.sqrt(n), seed))
            if seed in cfg["sim_seeds"][: cfg.get("sim_xN_seeds", len(cfg["sim_seeds"]))]:
                cases.append((n, "average", "xN", float(n), seed))
    results = []
    for n, method, label, factor, seed in tqdm(cases, desc="simulated runs", unit="run"):
        pl.seed_everything(seed, verbose=False)
        module = BenchNet(lr=lr, total_steps=onecycle_steps(cap, n, batch))
        res = simulate(
            module,
            train,
            num_workers=n,
            batch_size=batch,
            method=method,
            lr_factor=factor,
            max_epochs=cap,
            sampler_seed=seed,
            val_dataset=val,
            target=target,
        )
        tqdm.write(
            f"simulated N={n} {method} {label} seed {seed}: val_acc "
            f"{[round(h['val_acc'], 4) for h in res.history]} ({res.history[-1]['wall_s']:.0f} s)"
        )
        results.append(
            {
                "np": n,
                "method": f"{method}_{label}" if (method, label) != ("adasum", "x1") else "adasum",
                "factor": factor,
                "seed": seed,
                "steps_per_epoch": res.steps_per_epoch,
                "epochs_to_target": res.epochs_to_target,
                "steps_to_target": res.steps_to_target,
                "history": res.history,
                "diverged": res.diverged,
            }
        )
    return results
