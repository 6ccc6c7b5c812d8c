"""Statistical efficiency on real MNIST with real processes: Adasum vs averaging at N = 1, 2, 4, 8.

1. Baseline grid on 1 process (peak learning rate of SGD momentum 0.9 with a linear one-cycle schedule
   over the epoch cap); the winner reaches the target in the fewest epochs (ties: higher accuracy).
2. For every N > 1, per-process batch fixed: ``horovod_adasum`` with the winner's learning rate unscaled,
   and ``horovod`` (averaging) with the learning rate × N, × √N and × 1; × N and Adasum over every seed,
   × 1 and × √N over the first seed, then the best averaging factor over the other seeds too; for N in
   ``ddp_sizes`` also ``ddp_adasum`` (learning rate unscaled, every seed; Lightning's own launcher,
   ``--devices N``, where the Horovod strategies run under ``horovodrun -np N``).
   N = 1 is the baseline itself (all methods are plain training there).
   Every run stops at the first epoch whose validation accuracy reaches the target, or at the cap.

Writes ``<results>/study_real.json`` with every run's per-epoch history and command.
:func:`run_ddp_rows` (part ``study_ddp``) adds the ``ddp_adasum`` rows to an existing study instead, next
to ``horovod_adasum`` rows re-run in the same session (same baseline, recipe and seeds).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from tqdm.auto import tqdm

from benchmarks.common import command_line, horovodrun, lightning_launch, logs_for


def _run(np: int, name: str, opts: dict, out_dir: Path, bar) -> dict:
    """One ``benchmarks.lightning_run`` job: ``horovodrun -np N`` for the Horovod strategies, a plain
    ``python`` process with ``--devices N`` (Lightning starts the others) for ``ddp_adasum``."""
    out = out_dir / "runs" / f"{name}.json"
    ddp = opts.get("strategy") == "ddp_adasum"
    if ddp:
        opts = {**opts, "devices": np}
    args = ["benchmarks.lightning_run", str(out)]
    for key, value in opts.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    bar.set_postfix_str(name)
    log = logs_for(out_dir) / f"{name}.log"
    wall = lightning_launch(args, log=log) if ddp else horovodrun(np, args, log=log)
    result = json.loads(out.read_text())
    launcher = "lightning" if ddp else "horovodrun"
    result.update(name=name, np=np, command=command_line(np, args, launcher), job_wall_s=wall)
    hist = result["history"]
    bar.write(
        f"{name}: epochs {len(hist)}, val_acc {[round(h['val_acc'], 4) for h in hist]}, job {wall:.0f} s"
    )
    bar.update(1)
    return result


def epochs_to(history: list[dict], target: float) -> tuple[int | None, int | None]:
    """First (epoch, optimizer step) whose ``val_acc`` ≥ ``target``; (None, None) if never."""
    for h in history:
        if h["val_acc"] >= target:
            return h["epoch"], h["step"]
    return None, None


def _score(result: dict, target: float) -> tuple:
    epoch, _ = epochs_to(result["history"], target)
    best = max((h["val_acc"] for h in result["history"]), default=0.0)
    return (epoch if epoch is not None else math.inf, -best)


def run_study(cfg: dict, out_dir: Path) -> dict:
    """Run the grid and the scaling runs described by ``cfg``; returns (and writes) the results."""
    target, cap, batch = cfg["target"], cfg["epochs"], cfg["batch_size"]
    seeds, sizes, lrs = cfg["seeds"], cfg["sizes"], cfg["grid_lrs"]
    common = {"epochs": cap, "batch_size": batch, "target": target, "momentum": 0.9, "schedule": "onecycle"}
    ddp_sizes = [n for n in cfg.get("ddp_sizes", []) if n > 1]
    n_runs = len(lrs) + (len(seeds) - 1) + sum(3 * len(seeds) + 1 for n in sizes if n > 1)
    n_runs += len(ddp_sizes) * len(seeds)
    bar = tqdm(total=n_runs, desc="real runs", unit="run")
    grid = [
        _run(1, f"grid_lr{lr:g}_s{seeds[0]}", {**common, "lr": lr, "seed": seeds[0]}, out_dir, bar)
        for lr in lrs
    ]
    winner = min(grid, key=lambda r: _score(r, target))
    lr = winner["config"]["lr"]
    bar.write(f"baseline winner: lr {lr:g}")
    runs = [dict(winner, method="baseline", factor=1.0, seed=seeds[0])]
    for seed in seeds[1:]:
        r = _run(1, f"n1_baseline_s{seed}", {**common, "lr": lr, "seed": seed}, out_dir, bar)
        runs.append(dict(r, method="baseline", factor=1.0, seed=seed))
    for n in [n for n in sizes if n > 1]:
        factors = {"x1": 1.0, "xsqrtN": math.sqrt(n), "xN": float(n)}
        for seed in seeds:
            opts = {**common, "lr": lr, "seed": seed, "strategy": "horovod_adasum", "lr_factor": 1.0}
            runs.append(
                dict(
                    _run(n, f"n{n}_adasum_s{seed}", opts, out_dir, bar),
                    method="adasum",
                    factor=1.0,
                    seed=seed,
                )
            )
            if n in ddp_sizes:
                runs.append(_ddp_run(n, seed, common, lr, out_dir, bar))
        avg: dict[str, list[dict]] = {}
        for label, factor in factors.items():
            for seed in seeds if label == "xN" else seeds[:1]:
                opts = {**common, "lr": lr, "seed": seed, "strategy": "horovod", "lr_factor": factor}
                r = _run(n, f"n{n}_average_{label}_s{seed}", opts, out_dir, bar)
                avg.setdefault(label, []).append(dict(r, method=f"average_{label}", factor=factor, seed=seed))
        best = min(factors, key=lambda label: _score(avg[label][0], target))
        if best != "xN":
            for seed in seeds[1:]:
                opts = {**common, "lr": lr, "seed": seed, "strategy": "horovod", "lr_factor": factors[best]}
                r = _run(n, f"n{n}_average_{best}_s{seed}", opts, out_dir, bar)
                avg[best].append(dict(r, method=f"average_{best}", factor=factors[best], seed=seed))
        else:
            bar.update(len(seeds) - 1)
        for label, rs in avg.items():
            for r in rs:
                r["best_average"] = label == best
                runs.append(r)
    bar.close()
    return {
        "config": cfg,
        "grid": [dict(r, lr=r["config"]["lr"]) for r in grid],
        "baseline_lr": lr,
        "runs": runs,
    }


def _ddp_run(n: int, seed: int, common: dict, lr: float, out_dir: Path, bar) -> dict:
    opts = {**common, "lr": lr, "seed": seed, "strategy": "ddp_adasum", "lr_factor": 1.0}
    return dict(
        _run(n, f"n{n}_ddp_adasum_s{seed}", opts, out_dir, bar), method="ddp_adasum", factor=1.0, seed=seed
    )


def run_ddp_rows(cfg: dict, out_dir: Path) -> dict:
    """Add ``ddp_adasum`` rows to the study in ``out_dir/study_real.json`` (part ``study_ddp``).

    For N in ``cfg["ddp_sizes"]`` and every seed: ``horovod_adasum`` and ``ddp_adasum``, lr × 1, the study's
    baseline learning rate, recipe and seeds, one after the other. The fresh ``horovod_adasum`` rows replace
    the study's (kept under ``superseded_runs`` with the date of their run), so that both methods' rows come
    from this session's code. Returns the updated study (not written).
    """
    study = json.loads((out_dir / "study_real.json").read_text())
    for key in ("target", "epochs", "batch_size", "seeds"):
        if study["config"][key] != cfg[key]:
            raise ValueError(f"study_real.json has {key}={study['config'][key]!r}, this config {cfg[key]!r}")
    target, cap, batch, seeds = cfg["target"], cfg["epochs"], cfg["batch_size"], cfg["seeds"]
    lr = study["baseline_lr"]
    common = {"epochs": cap, "batch_size": batch, "target": target, "momentum": 0.9, "schedule": "onecycle"}
    sizes = [n for n in cfg["ddp_sizes"] if n > 1]
    bar = tqdm(total=2 * len(sizes) * len(seeds), desc="ddp_adasum rows", unit="run")
    fresh = []
    for n in sizes:
        for seed in seeds:
            opts = {**common, "lr": lr, "seed": seed, "strategy": "horovod_adasum", "lr_factor": 1.0}
            r = _run(n, f"n{n}_adasum_s{seed}", opts, out_dir, bar)
            fresh.append(dict(r, method="adasum", factor=1.0, seed=seed))
            fresh.append(_ddp_run(n, seed, common, lr, out_dir, bar))
    bar.close()
    replaced = {(r["np"], r["method"], r["seed"]) for r in fresh}
    date = study.get("environment", {}).get("date_utc")
    kept, superseded = [], list(study.get("superseded_runs", []))
    for r in study["runs"]:
        if (r["np"], r["method"], r["seed"]) in replaced:
            superseded.append(dict(r, superseded_run_date=date))
        else:
            kept.append(r)
    order = {m: i for i, m in enumerate(["baseline", "adasum", "ddp_adasum"])}
    runs = sorted(kept + fresh, key=lambda r: (r["np"], order.get(r["method"], len(order)), r["seed"]))
    return {
        **{k: v for k, v in study.items() if k not in ("benchmark", "command", "mode", "environment")},
        "config": {**study["config"], "ddp_sizes": cfg["ddp_sizes"]},
        "runs": runs,
        "superseded_runs": superseded,
        "ddp_rows": {"sizes": sizes, "seeds": seeds, "study_environment": study.get("environment")},
    }
