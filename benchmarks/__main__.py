"""``python -m benchmarks [--quick] [--only PART,...]``: run the benchmarks and write the results.

Parts, in order: ``study`` (real processes), ``simulated`` (validation + N = 8 … 64), ``overhead``
(Lightning vs raw Horovod loop), ``allreduce`` (Adasum vs Average vs Sum; ``adasum_allreduce`` over Gloo
vs Horovod's Adasum), ``memory`` (peak RSS), then
``report`` (``docs/benchmarks.md`` and its PNGs). ``make bench`` runs everything with :data:`FULL`;
``make bench-quick`` runs :data:`QUICK` into ``benchmarks/results/quick/`` (the docs are left alone; its
report goes to ``benchmarks/results/quick/report.md``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from tqdm.auto import tqdm

from benchmarks.common import (
    RESULTS,
    ROOT,
    command_line,
    environment,
    horovodrun,
    logs_for,
    prepared_root,
    write_results,
)

#: ``make bench``: sized for ≈ 60 minutes on a 2-core machine (see docs/benchmarks.md).
FULL = {
    "target": 0.99,
    "lower_target": 0.985,
    "epochs": 4,
    "batch_size": 32,
    "grid_lrs": [0.02, 0.035, 0.05, 0.07],
    "sizes": [1, 2, 4, 8],
    "seeds": [0, 1],
    "validation_steps": 300,
    "validation_cases": [[2, "adasum"], [4, "adasum"], [4, "average"]],
    "sim_sizes": [8, 16, 32, 64],
    "sim_seeds": [0, 1],
    "sim_epochs": 4,
    "sim_average_factors": ["xN", "xsqrtN"],
    "sim_xN_seeds": 1,
    "sim_adasum_factors": ["x1", "x2"],
    "overhead_sizes": [2, 4],
    "overhead_repeats": 2,
    "allreduce_sizes": [2, 4],
    "allreduce_kb": [4 * 2**i for i in range(15)],
    "memory_sizes": [2, 4],
    "memory_batches": 300,
}

#: ``make bench-quick``: the same pipeline, reduced to fit in under 10 minutes.
QUICK = {
    **FULL,
    "target": 0.98,
    "lower_target": 0.97,
    "epochs": 1,
    "grid_lrs": [0.05],
    "sizes": [1, 2, 4],
    "seeds": [0],
    "validation_steps": 100,
    "validation_cases": [[2, "adasum"], [4, "adasum"]],
    "sim_sizes": [8, 16],
    "sim_seeds": [0],
    "sim_epochs": 1,
    "sim_average_factors": ["xN"],
    "overhead_sizes": [2],
    "overhead_repeats": 1,
    "allreduce_sizes": [2],
    "allreduce_kb": [4, 256, 16384, 65536],
    "memory_sizes": [2],
    "memory_batches": 50,
}

PARTS = ["study", "simulated", "overhead", "allreduce", "memory", "report"]


def overhead(cfg: dict, out_dir: Path) -> dict:
    """Lightning + horovod_adasum vs the raw Horovod loop, interleaved: L, R, L, R, … per size."""
    runs = []
    jobs = [
        (n, impl)
        for n in cfg["overhead_sizes"]
        for _ in range(cfg["overhead_repeats"])
        for impl in ("lightning", "raw")
    ]
    for n, impl in tqdm(jobs, desc="overhead", unit="run"):
        out = out_dir / "runs" / f"throughput_{impl}_n{n}.json"
        args = ["benchmarks.throughput", str(out), "--impl", impl]
        horovodrun(n, args, log=logs_for(out_dir) / f"throughput_{impl}_n{n}.log")
        runs.append({**json.loads(out.read_text()), "command": command_line(n, args)})
    summary = []
    for n in cfg["overhead_sizes"]:
        light = [r["steps_per_s"] for r in runs if r["world_size"] == n and r["impl"] == "lightning"]
        raw = [r["steps_per_s"] for r in runs if r["world_size"] == n and r["impl"] == "raw"]
        pairs = [a / b for a, b in zip(light, raw, strict=True)]
        summary.append(
            {
                "np": n,
                "lightning_steps_per_s_median": statistics.median(light),
                "raw_steps_per_s_median": statistics.median(raw),
                "ratio_of_medians": statistics.median(light) / statistics.median(raw),
                "ratio_per_pair": pairs,
            }
        )
    return {"runs": runs, "summary": summary}


def allreduce(cfg: dict, out_dir: Path) -> dict:
    """Horovod's Adasum vs Average vs Sum (``jobs``), then ``adasum_allreduce`` over Gloo vs Horovod's
    Adasum vs Gloo's sum (``adasum_allreduce_jobs``, with a time breakdown at N = 2)."""
    sizes = ",".join(map(str, cfg["allreduce_kb"]))
    results, ours = [], []
    jobs = [(n, part) for part in ("horovod_ops", "adasum_allreduce") for n in cfg["allreduce_sizes"]]
    for n, part in tqdm(jobs, desc="allreduce", unit="job"):
        if part == "horovod_ops":
            out = out_dir / "runs" / f"allreduce_n{n}.json"
            args = ["benchmarks.allreduce", str(out), "--sizes-kb", sizes]
        else:
            out = out_dir / "runs" / f"adasum_allreduce_n{n}.json"
            args = ["benchmarks.adasum_allreduce", str(out), "--sizes-kb", sizes]
            if n == 2:
                args += ["--breakdown-kb", str(max(cfg["allreduce_kb"]))]
        horovodrun(n, args, log=logs_for(out_dir) / f"{out.stem}.log")
        (results if part == "horovod_ops" else ours).append(
            {**json.loads(out.read_text()), "command": command_line(n, args)}
        )
    return {"jobs": results, "adasum_allreduce_jobs": ours}


def memory(cfg: dict, out_dir: Path, root: str) -> dict:
    """Peak RSS per process of the example under horovod_adasum vs horovod (same job otherwise)."""
    rows = []
    jobs = [(n, s) for n in cfg["memory_sizes"] for s in ("horovod_adasum", "horovod")]
    for n, strategy in tqdm(jobs, desc="memory", unit="run"):
        rss_dir = out_dir / "runs" / f"rss_{strategy}_n{n}"
        args = [
            "benchmarks.rss_example",
            str(rss_dir),
            "fit",
            "--config",
            "examples/mnist.yaml",
            f"--trainer.strategy={strategy}",
            "--trainer.max_epochs=1",
            f"--trainer.limit_train_batches={cfg['memory_batches']}",
            "--trainer.limit_val_batches=2",
            "--trainer.enable_progress_bar=false",
            f"--data.data_dir={root}",
            f"--trainer.default_root_dir={logs_for(out_dir) / 'rss'}",
        ]
        horovodrun(n, args, log=logs_for(out_dir) / f"rss_{strategy}_n{n}.log")
        per_rank = [json.loads((rss_dir / f"rss_rank{r}.json").read_text())["peak_rss_kb"] for r in range(n)]
        rows.append(
            {
                "np": n,
                "strategy": strategy,
                "peak_rss_kb_per_rank": per_rank,
                "command": command_line(n, args),
            }
        )
    return {"runs": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the reduced configuration (under 10 minutes)")
    p.add_argument("--only", default=",".join(PARTS), help="comma-separated parts to run")
    args = p.parse_args()
    cfg = QUICK if args.quick else FULL
    out_dir = RESULTS / "quick" if args.quick else RESULTS
    (out_dir / "runs").mkdir(parents=True, exist_ok=True)
    parts = args.only.split(",")
    env = environment()
    root = prepared_root()
    timings = {}
    mode = "quick" if args.quick else "full"

    def save(name: str, payload: dict) -> None:
        path = write_results(
            f"{'quick/' if args.quick else ''}{name}", {"mode": mode, "environment": env, **payload}
        )
        tqdm.write(f"wrote {path.relative_to(ROOT)}")

    start_all = time.perf_counter()
    if "study" in parts:
        from benchmarks.study import run_study

        start = time.perf_counter()
        save("study_real", run_study(cfg, out_dir))
        timings["study"] = time.perf_counter() - start
    if "simulated" in parts:
        from benchmarks.simulated import scaling, validate

        study = json.loads((out_dir / "study_real.json").read_text())
        lr = study["baseline_lr"]
        start = time.perf_counter()
        save(
            "simulator_validation",
            {"config": cfg, "baseline_lr": lr, "cases": validate(cfg, lr, root, out_dir)},
        )
        timings["simulator_validation"] = time.perf_counter() - start
        start = time.perf_counter()
        save("study_simulated", {"config": cfg, "baseline_lr": lr, "runs": scaling(cfg, lr, root)})
        timings["simulated"] = time.perf_counter() - start
    if "overhead" in parts:
        start = time.perf_counter()
        save("overhead", {"config": cfg, **overhead(cfg, out_dir)})
        timings["overhead"] = time.perf_counter() - start
    if "allreduce" in parts:
        start = time.perf_counter()
        save("allreduce", {"config": cfg, **allreduce(cfg, out_dir)})
        timings["allreduce"] = time.perf_counter() - start
    if "memory" in parts:
        start = time.perf_counter()
        save("memory", {"config": cfg, **memory(cfg, out_dir, root)})
        timings["memory"] = time.perf_counter() - start
    if "report" in parts:
        from benchmarks.report import write_report

        if set(parts) != {"report"}:
            save("timings", {"parts_s": timings, "total_s": time.perf_counter() - start_all, "parts": parts})
        write_report(out_dir, quick=args.quick)


if __name__ == "__main__":
    main()
