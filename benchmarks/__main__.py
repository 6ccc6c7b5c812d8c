"""``python -m benchmarks [--quick] [--only PART,...]``: run the benchmarks and write the results.

Parts, in order: ``study`` (real processes; ``horovod_adasum``, ``ddp_adasum`` and averaging), ``simulated``
(validation + N = 8 … 64), ``elastic_study`` (simulated, the world going 4 → 2 → 4 between epochs: Adasum at
lr × 1 and averaging at lr × 4, each beside its uninterrupted 4-rank run; ``benchmarks/elastic_study.py``),
``throughput`` (``ddp_adasum`` vs ``horovod_adasum``, steps/s), ``overhead``
(Lightning vs raw Horovod loop), ``loops`` (the three forms of ``ddp_adasum`` — plain loop, Fabric, Trainer —
and DDP, on the example's CNN and a 57 MB MLP), ``local_sgd_throughput`` (the Trainer's ``ddp_adasum`` every
step and with ``sync_every=10`` beside ``ddp`` on that MLP), ``fsdp_memory`` (peak memory per rank and step
time of ``fsdp_adasum`` beside Lightning's HSDP on the same 2 × 2 mesh, that MLP), ``slow_link`` (that MLP on
a rate-limited link: Lightning ``ddp``, its post-local SGD and ``ddp_adasum``'s variants, steps/s and time to
a target loss; ``benchmarks/slow_link.py``; needs root), ``allreduce`` (Adasum vs Average vs Sum;
``adasum_allreduce`` over Gloo vs Horovod's Adasum), ``memory`` (peak RSS), then ``report``
(``docs/benchmarks.md`` and its PNGs). Not run by default: ``study_ddp`` (only the study's ``ddp_adasum``
rows, with ``horovod_adasum`` re-run beside them, merged into an existing ``study_real.json``) and
``local_sgd`` (DiLoCo / local SGD with Adasum or averaging, ``benchmarks/local_sgd.py``; ≈ 2.3 CPU-hours,
``--quick`` ≈ 20 s; writes ``local_sgd.json`` and its PNGs, docs/local_sgd.md reads them). ``make bench`` runs
everything with :data:`FULL`; ``make bench-quick`` runs :data:`QUICK` into ``benchmarks/results/quick/`` (the
docs are left alone; its report goes to ``benchmarks/results/quick/report.md``). Each part's wall time is
merged into ``timings.json`` (latest run of each part, with its date).
"""

from __future__ import annotations

import argparse
import json
import os
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
    lightning_launch,
    logs_for,
    prepared_root,
    torchrun,
    write_results,
)

#: ``slow_link``'s variants at the slower rate and on the second rig (what the target ratios need).
SLOW_LINK_HEADLINE = [
    "ddp",
    "post_local_sgd_10",
    "adasum_bf16",
    "adasum_bf16_overlap_backward",
    "adasum_s10",
    "adasum_s10_overlap_bf16",
    "ceiling",
]

#: ``make bench``: sized for a 2-core machine (its duration: docs/benchmarks.md).
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
    # World size per epoch of the elastic runs (the uninterrupted ones stay at the first), and their seeds.
    "elastic_schedule": [4, 2, 4],
    "elastic_seeds": [0, 1],
    "ddp_sizes": [2, 4],
    "throughput_sizes": [2, 4],
    "throughput_repeats": 4,
    "overhead_sizes": [2, 4],
    "overhead_repeats": 3,
    "allreduce_sizes": [2, 4],
    "allreduce_kb": [4 * 2**i for i in range(15)],
    "memory_sizes": [2, 4],
    "memory_batches": 300,
    "loops_sizes": [2, 4],
    "loops_models": ["cnn", "mlp"],
    "loops_repeats": 3,
    "loops_steps": {"cnn": 400, "mlp": 40},
    "loops_skip": 5,
    "local_sgd_throughput_sizes": [2],
    "local_sgd_throughput_models": ["mlp"],
    "local_sgd_throughput_repeats": 4,
    # Steps 10 … 69 are timed: exactly 6 syncs at H = 10, none of them the end-of-fit partial window.
    "local_sgd_throughput_steps": {"mlp": 70},
    "local_sgd_throughput_skip": 10,
    "fsdp_memory_devices": 4,
    "fsdp_memory_shard_size": 2,
    "fsdp_memory_repeats": 3,
    "fsdp_memory_steps": 30,
    # Rig, link rate, variants (benchmarks/slow_link.py) and interleaved rounds per block; warm-up and timed
    # steps by the variant's period (whole windows: the timed steps hold exactly timed / period exchanges).
    # Two warm-up windows: with overlap_sync the first exchange, which pays the first-use costs, lands at the
    # end of the second, as the first exchange without overlap lands at the end of the first. Six timed
    # windows at H = 10 and 7 rounds at 1 Gbit/s: the aim for the overlapped run is a threshold on a median
    # that varies from job to job (docs/benchmarks.md).
    "slow_link": {
        "blocks": [
            {"rig": "loopback", "rate": "1gbit", "variants": "all", "rounds": 7},
            {
                "rig": "loopback",
                "rate": "250mbit",
                "variants": SLOW_LINK_HEADLINE,
                "rounds": 2,
                "steps": {"1": [2, 4]},
            },
            {"rig": "two_hosts", "rate": "1gbit", "variants": SLOW_LINK_HEADLINE, "rounds": 2},
        ],
        "steps": {"1": [3, 10], "10": [20, 60], "50": [100, 50], "1000": [10, 60]},
        "timeout_s": 600,
        "target": {
            "rate": "1gbit",
            "lr": 0.05,
            "target_loss": 0.25,
            "eval_every": 10,
            "val_samples": 1000,
            "max_steps": 1000,
            "max_train_s": 240,
            "combinations": ["nesterov", "mean"],
        },
    },
}

#: ``make bench-quick``: the same pipeline, reduced (its time limit: docs/development.md).
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
    "elastic_schedule": [4, 2],
    "elastic_seeds": [0],
    "throughput_sizes": [2],
    "throughput_repeats": 1,
    "overhead_sizes": [2],
    "overhead_repeats": 1,
    "allreduce_sizes": [2],
    "allreduce_kb": [4, 256, 16384, 65536],
    "memory_sizes": [2],
    "memory_batches": 50,
    "loops_sizes": [2],
    "loops_repeats": 1,
    "loops_steps": {"cnn": 150, "mlp": 20},
    "local_sgd_throughput_repeats": 1,
    "local_sgd_throughput_steps": {"mlp": 30},
    "fsdp_memory_repeats": 1,
    "fsdp_memory_steps": 15,
    "slow_link": {
        **FULL["slow_link"],
        "blocks": [
            {"rig": "loopback", "rate": "1gbit", "variants": "all", "rounds": 1},
            {"rig": "two_hosts", "rate": "1gbit", "variants": ["ddp", "adasum_s10", "ceiling"], "rounds": 1},
        ],
        "steps": {"1": [1, 3], "10": [20, 10], "50": [100, 50], "1000": [5, 20]},
        "target": {**FULL["slow_link"]["target"], "target_loss": 0.8, "max_steps": 100, "max_train_s": 60},
    },
}

#: The forms the ``local_sgd_throughput`` part compares: every-step Adasum, local SGD (H = 10) and DDP.
LOCAL_SGD_IMPLS = ("trainer_ddp", "trainer_adasum", "trainer_adasum_sync10")

PARTS = [
    "study",
    "simulated",
    "elastic_study",
    "throughput",
    "overhead",
    "loops",
    "local_sgd_throughput",
    "fsdp_memory",
    "slow_link",
    "allreduce",
    "memory",
    "report",
]
#: Parts run only when named in ``--only``.
#: ``slow_link_overlap``: the aim's row alone beside the ceiling and its neighbours (the 1 Gbit/s loopback
#: block of ``slow_link`` with these variants, in the same interleaved rounds; no time to target).
SLOW_LINK_OVERLAP = ["ceiling", "adasum_s10_overlap_bf16", "adasum_s10_bf16", "adasum_s10_overlap"]
EXTRA_PARTS = ["study_ddp", "local_sgd", "slow_link_overlap"]


def _ratios(runs: list[dict], sizes: list[int], num: str, den: str) -> list[dict]:
    """Per size: steps/s of the ``num`` and ``den`` runs, the ratio of their medians, the ratio per pair (runs
    back to back, so each pair shares the machine's load of the moment) and the median of those, and the ratio
    of the best runs (the least disturbed by other work)."""
    summary = []
    for n in sizes:
        a = [r["steps_per_s"] for r in runs if r["world_size"] == n and r["impl"] == num]
        b = [r["steps_per_s"] for r in runs if r["world_size"] == n and r["impl"] == den]
        summary.append(
            {
                "np": n,
                f"{num}_steps_per_s": a,
                f"{den}_steps_per_s": b,
                f"{num}_steps_per_s_median": statistics.median(a),
                f"{den}_steps_per_s_median": statistics.median(b),
                "ratio_of_medians": statistics.median(a) / statistics.median(b),
                "ratio_per_pair": [x / y for x, y in zip(a, b, strict=True)],
                "median_of_pair_ratios": statistics.median(x / y for x, y in zip(a, b, strict=True)),
                "ratio_of_best": max(a) / max(b),
                f"{num}_cpu_ms_per_step_median": _median_cpu(runs, n, num),
                f"{den}_cpu_ms_per_step_median": _median_cpu(runs, n, den),
            }
        )
    return summary


def _median_cpu(runs: list[dict], n: int, impl: str) -> float | None:
    """Median over runs and ranks of the CPU milliseconds per step of one process (all its threads)."""
    values = [
        c
        for r in runs
        if r["world_size"] == n and r["impl"] == impl
        for c in r.get("cpu_ms_per_step_per_rank", [])
    ]
    return statistics.median(values) if values else None


def throughput(cfg: dict, out_dir: Path) -> dict:
    """Lightning + ddp_adasum (Lightning's launcher, ``devices=N``) vs Lightning + horovod_adasum
    (``horovodrun -np N``), same model, data and seed; interleaved D, H, H, D, D, H, … per size (the order
    alternates, so that a trend in the machine's load hits both alike)."""
    runs = []
    jobs = []
    for n in cfg["throughput_sizes"]:
        for i in range(cfg["throughput_repeats"]):
            pair = ("ddp_adasum", "lightning") if i % 2 == 0 else ("lightning", "ddp_adasum")
            jobs += [(n, i, impl) for impl in pair]
    for n, i, impl in tqdm(jobs, desc="throughput", unit="run"):
        out = out_dir / "runs" / f"throughput_{impl}_n{n}.json"
        log = logs_for(out_dir) / f"throughput_{impl}_n{n}_r{i}.log"
        load = os.getloadavg()
        args = ["benchmarks.throughput", str(out), "--impl", impl]
        if impl == "ddp_adasum":
            args += ["--devices", str(n)]
            wall = lightning_launch(args, log=log)
            command = command_line(n, args, "lightning")
        else:
            wall = horovodrun(n, args, log=log)
            command = command_line(n, args)
        record = {"repeat": i, "job_wall_s": wall, "loadavg_before": load, "command": command}
        runs.append({**json.loads(out.read_text()), **record})
    return {"runs": runs, "summary": _ratios(runs, cfg["throughput_sizes"], "ddp_adasum", "lightning")}


def overhead(cfg: dict, out_dir: Path) -> dict:
    """Lightning + horovod_adasum vs the raw Horovod loop, interleaved: L, R, N, L, R, N, … per size, where N
    is Lightning without its per-step SIGTERM broadcast over torch.distributed (a diagnostic of that cost)."""
    runs = []
    jobs = [
        (n, i, impl)
        for n in cfg["overhead_sizes"]
        for i in range(cfg["overhead_repeats"])
        for impl in ("lightning", "raw", "lightning_no_sigterm_broadcast")
    ]
    for n, i, impl in tqdm(jobs, desc="overhead", unit="run"):
        out = out_dir / "runs" / f"overhead_{impl}_n{n}.json"
        args = ["benchmarks.throughput", str(out), "--impl", impl]
        load = os.getloadavg()
        wall = horovodrun(n, args, log=logs_for(out_dir) / f"overhead_{impl}_n{n}_r{i}.log")
        record = {"repeat": i, "job_wall_s": wall, "loadavg_before": load, "command": command_line(n, args)}
        runs.append({**json.loads(out.read_text()), **record})
    return {
        "runs": runs,
        "summary": _ratios(runs, cfg["overhead_sizes"], "lightning", "raw"),
        "summary_without_sigterm_broadcast": _ratios(
            runs, cfg["overhead_sizes"], "lightning_no_sigterm_broadcast", "raw"
        ),
    }


#: ``loops``: the ratios reported, (numerator, denominator): each form against the plain loop of its kind, and
#: ``ddp_adasum`` against Lightning's ``ddp``.
LOOPS_RATIOS = (
    ("fabric_adasum", "plain_adasum"),
    ("trainer_adasum", "plain_adasum"),
    ("trainer_ddp", "plain_ddp"),
    ("plain_adasum", "plain_ddp"),
    ("trainer_adasum", "trainer_ddp"),
    ("trainer_adasum_overlap", "trainer_ddp"),
    ("trainer_adasum_overlap", "trainer_adasum"),
    ("trainer_adasum_sync10", "trainer_ddp"),
    ("trainer_adasum_sync10", "trainer_adasum"),
    ("trainer_horovod_adasum", "trainer_ddp"),
    ("trainer_adasum", "trainer_horovod_adasum"),
    ("trainer_adasum_iterable", "trainer_adasum"),
    ("plain_adasum_backward", "plain_adasum"),
    ("plain_adasum_backward", "plain_ddp"),
    ("plain_adasum", "plain_local"),
    ("plain_ddp", "plain_local"),
)


def loops(cfg: dict, out_dir: Path, impls: tuple[str, ...] | None = None, prefix: str = "loops") -> dict:
    """Steps/s of plain DDP, plain Adasum (``AdasumOptimizer``), Fabric ``ddp_adasum``, Trainer ``ddp`` and
    Trainer ``ddp_adasum`` (``benchmarks/loops.py``; ``impls``: a subset), per model and world size
    (``cfg[prefix + "_models"]``, ``…_sizes``, ``…_repeats``, ``…_steps``, ``…_skip``: untimed warm-up
    steps), in interleaved rounds: each round runs every form once, the order rotated by one each round, so
    that a trend in the machine's load hits every form alike. World sizes above the 2 cores are marked
    ``oversubscribed``."""
    from benchmarks.loops import IMPLS

    impls = impls or IMPLS
    ratios = [(a, b) for a, b in LOOPS_RATIOS if a in impls and b in impls]
    runs, jobs = [], []
    for model in cfg[f"{prefix}_models"]:
        for n in cfg[f"{prefix}_sizes"]:
            for i in range(cfg[f"{prefix}_repeats"]):
                order = impls[i % len(impls) :] + impls[: i % len(impls)]
                jobs += [(model, n, i, impl) for impl in order]
    for model, n, i, impl in tqdm(jobs, desc="loops", unit="run"):
        out = out_dir / "runs" / f"{prefix}_{model}_{impl}_n{n}.json"
        log = logs_for(out_dir) / f"{prefix}_{model}_{impl}_n{n}_r{i}.log"
        args = ["benchmarks.loops", str(out), "--impl", impl, "--model", model,
                "--steps", str(cfg[f"{prefix}_steps"][model]),
                "--skip", str(cfg[f"{prefix}_skip"])]  # fmt: skip
        load = os.getloadavg()
        if impl.startswith("plain"):
            wall, command = torchrun(n, args, log=log), command_line(n, args, "torchrun")
        elif impl == "trainer_horovod_adasum":
            wall, command = horovodrun(n, args, log=log), command_line(n, args)
        else:
            args += ["--devices", str(n)]
            wall, command = lightning_launch(args, log=log), command_line(n, args, "lightning")
        record = {"repeat": i, "job_wall_s": wall, "loadavg_before": load, "command": command,
                  "oversubscribed": n > (os.cpu_count() or 1)}  # fmt: skip
        runs.append({**json.loads(out.read_text()), **record})
    summary = []
    for model in cfg[f"{prefix}_models"]:
        for n in cfg[f"{prefix}_sizes"]:
            these = [r for r in runs if r["model"] == model and r["world_size"] == n]
            row = {"model": model, "np": n, "oversubscribed": these[0]["oversubscribed"]}
            for impl in impls:
                mine = [r for r in these if r["impl"] == impl]
                row[impl] = {
                    "steps_per_s": [r["steps_per_s"] for r in mine],
                    "steps_per_s_median": statistics.median(r["steps_per_s"] for r in mine),
                    "reduction_ms_per_step_median": statistics.median(
                        r["reduction_ms_per_step"] for r in mine
                    ),
                    "peak_rss_mb_max": max(max(r["peak_rss_mb_per_rank"]) for r in mine),
                    "reduced_bytes_per_sample_median": statistics.median(
                        r.get("reduced_bytes_per_sample", 0) for r in mine
                    ),
                }
            for num, den in ratios:
                per_round = [
                    a["steps_per_s"] / b["steps_per_s"]
                    for a in these if a["impl"] == num
                    for b in these if b["impl"] == den and b["repeat"] == a["repeat"]
                ]  # fmt: skip
                row[f"{num}/{den}"] = {
                    "per_round": per_round,
                    "median": statistics.median(per_round),
                    "min": min(per_round),
                    "max": max(per_round),
                }
            summary.append(row)
    return {"runs": runs, "summary": summary}


def _spread(values: list[float]) -> dict:
    return {"values": values, "median": statistics.median(values), "min": min(values), "max": max(values)}


def fsdp_memory(cfg: dict, out_dir: Path) -> dict:
    """Peak memory per rank and step time of the Trainer's ``fsdp_adasum`` beside Lightning's HSDP
    (``ModelParallelStrategy``, ``fully_shard`` on the 2-D mesh: averaging) on the same mesh and MLP
    (``benchmarks/fsdp_memory.py``), in interleaved rounds (the order alternating). Per round, the difference
    of the largest rank's training peaks and the ratio of the step times; the target — ``fsdp_adasum``'s peak
    at most HSDP's plus one shard of the parameters — is checked on the median difference."""
    from benchmarks.fsdp_memory import IMPLS

    n, shard = cfg["fsdp_memory_devices"], cfg["fsdp_memory_shard_size"]
    runs = []
    for i in tqdm(range(cfg["fsdp_memory_repeats"]), desc="fsdp_memory", unit="round"):
        for impl in IMPLS if i % 2 == 0 else IMPLS[::-1]:
            out = out_dir / "runs" / f"fsdp_memory_{impl}.json"
            args = ["benchmarks.fsdp_memory", str(out), "--impl", impl, "--devices", str(n),
                    "--shard-size", str(shard), "--steps", str(cfg["fsdp_memory_steps"])]  # fmt: skip
            load = os.getloadavg()
            wall = lightning_launch(args, log=logs_for(out_dir) / f"fsdp_memory_{impl}_r{i}.log")
            record = {"repeat": i, "job_wall_s": wall, "loadavg_before": load,
                      "command": command_line(n, args, "lightning"),
                      "oversubscribed": n > (os.cpu_count() or 1)}  # fmt: skip
            runs.append({**json.loads(out.read_text()), **record})
    summary: dict = {"np": n, "shard_size": shard, "oversubscribed": runs[0]["oversubscribed"]}
    for impl in IMPLS:
        mine = [r for r in runs if r["impl"] == impl]
        summary[impl] = {
            "training_peak_rss_mb_max_rank": _spread([max(r["training_peak_rss_mb_per_rank"]) for r in mine]),
            "process_peak_rss_mb_max_rank": _spread([max(r["process_peak_rss_mb_per_rank"]) for r in mine]),
            "ms_per_step": _spread([r["ms_per_step"] for r in mine]),
        }
    pairs = [
        (a, b)
        for a in runs if a["impl"] == "fsdp_adasum"
        for b in runs if b["impl"] == "hsdp" and b["repeat"] == a["repeat"]
    ]  # fmt: skip
    shard_mb = runs[0]["parameter_shard_mb"]
    difference = _spread(
        [max(a["training_peak_rss_mb_per_rank"]) - max(b["training_peak_rss_mb_per_rank"]) for a, b in pairs]
    )
    summary["training_peak_difference_mb"] = difference
    summary["step_time_ratio"] = _spread([a["ms_per_step"] / b["ms_per_step"] for a, b in pairs])
    summary["parameter_shard_mb"] = shard_mb
    # Deterministic: the buffers fsdp_adasum's step keeps (the largest rank), in MiB and in its own shards.
    adasum_runs = [r for r in runs if r["impl"] == "fsdp_adasum"]
    summary["step_buffer_mb_max_rank"] = (
        max(max(r["step_buffer_bytes_per_rank"]) for r in adasum_runs) / 2**20
    )
    summary["step_buffer_shards_max_rank"] = max(max(r["step_buffer_shards_per_rank"]) for r in adasum_runs)
    summary["float64_scratch_mb_max_rank"] = (
        max(max(r["float64_scratch_bytes_per_rank"]) for r in adasum_runs) / 2**20
    )
    summary["target"] = "fsdp_adasum's training peak <= HSDP's + one shard of the parameters"
    summary["target_holds"] = difference["median"] <= shard_mb
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
    """Peak RSS per process of the example under horovod_adasum vs horovod vs ddp_adasum (same job otherwise;
    ddp_adasum started by Lightning's launcher, ``--trainer.devices=N``)."""
    rows = []
    strategies = ("horovod_adasum", "horovod", "ddp_adasum")
    jobs = [(n, s) for n in cfg["memory_sizes"] for s in strategies]
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
        log = logs_for(out_dir) / f"rss_{strategy}_n{n}.log"
        launcher = "lightning" if strategy == "ddp_adasum" else "horovodrun"
        if launcher == "lightning":
            args.append(f"--trainer.devices={n}")
            lightning_launch(args, log=log)
        else:
            horovodrun(n, args, log=log)
        per_rank = [json.loads((rss_dir / f"rss_rank{r}.json").read_text())["peak_rss_kb"] for r in range(n)]
        rows.append(
            {
                "np": n,
                "strategy": strategy,
                "peak_rss_kb_per_rank": per_rank,
                "command": command_line(n, args, launcher),
            }
        )
    return {"runs": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the reduced configuration (under 10 minutes)")
    p.add_argument(
        "--only",
        default=",".join(PARTS),
        help=f"comma-separated parts to run, of {','.join(PARTS + EXTRA_PARTS)} (default: {','.join(PARTS)})",
    )
    args = p.parse_args()
    cfg = QUICK if args.quick else FULL
    out_dir = RESULTS / "quick" if args.quick else RESULTS
    (out_dir / "runs").mkdir(parents=True, exist_ok=True)
    parts = args.only.split(",")
    unknown = set(parts) - set(PARTS + EXTRA_PARTS)
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}; known: {PARTS + EXTRA_PARTS}")
    if "study" in parts and "study_ddp" in parts:
        parts.remove("study_ddp")  # the whole study has the ddp_adasum rows
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
    if "study_ddp" in parts:
        from benchmarks.study import run_ddp_rows

        start = time.perf_counter()
        save("study_real", run_ddp_rows(cfg, out_dir))
        timings["study_ddp"] = time.perf_counter() - start
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
    if "elastic_study" in parts:
        from benchmarks.elastic_study import run as elastic_study

        study_path = out_dir / "study_real.json"
        study = json.loads((study_path if study_path.exists() else RESULTS / "study_real.json").read_text())
        start = time.perf_counter()
        save("elastic_study", {"config": cfg, **elastic_study(cfg, study["baseline_lr"], root)})
        timings["elastic_study"] = time.perf_counter() - start
    if "throughput" in parts:
        start = time.perf_counter()
        save("throughput", {"config": cfg, **throughput(cfg, out_dir)})
        timings["throughput"] = time.perf_counter() - start
    if "overhead" in parts:
        start = time.perf_counter()
        save("overhead", {"config": cfg, **overhead(cfg, out_dir)})
        timings["overhead"] = time.perf_counter() - start
    if "loops" in parts:
        start = time.perf_counter()
        save("loops", {"config": cfg, **loops(cfg, out_dir)})
        timings["loops"] = time.perf_counter() - start
    if "local_sgd_throughput" in parts:
        start = time.perf_counter()
        result = loops(cfg, out_dir, LOCAL_SGD_IMPLS, prefix="local_sgd_throughput")
        save("local_sgd_throughput", {"config": cfg, **result})
        timings["local_sgd_throughput"] = time.perf_counter() - start
    if "fsdp_memory" in parts:
        start = time.perf_counter()
        save("fsdp_memory", {"config": cfg, **fsdp_memory(cfg, out_dir)})
        timings["fsdp_memory"] = time.perf_counter() - start
    if "slow_link" in parts:
        from benchmarks.slow_link import run as slow_link

        start = time.perf_counter()
        save("slow_link", slow_link(cfg["slow_link"], out_dir, root))
        timings["slow_link"] = time.perf_counter() - start
    if "slow_link_overlap" in parts:
        from benchmarks.slow_link import run as slow_link

        start = time.perf_counter()
        block = {**cfg["slow_link"]["blocks"][0], "variants": SLOW_LINK_OVERLAP}
        part = {**cfg["slow_link"], "blocks": [block], "target": None}
        save("slow_link_overlap", slow_link(part, out_dir, root))
        timings["slow_link_overlap"] = time.perf_counter() - start
    if "allreduce" in parts:
        start = time.perf_counter()
        save("allreduce", {"config": cfg, **allreduce(cfg, out_dir)})
        timings["allreduce"] = time.perf_counter() - start
    if "memory" in parts:
        start = time.perf_counter()
        save("memory", {"config": cfg, **memory(cfg, out_dir, root)})
        timings["memory"] = time.perf_counter() - start
    if "local_sgd" in parts:
        from benchmarks import local_sgd

        start = time.perf_counter()
        local_sgd.main(["--quick"] if args.quick else [])
        timings["local_sgd"] = time.perf_counter() - start
    if timings:
        save("timings", _merged_timings(out_dir, timings, time.perf_counter() - start_all, parts, env))
    if "report" in parts:
        from benchmarks.report import write_report

        write_report(out_dir, quick=args.quick)


def _merged_timings(out_dir: Path, timings: dict, total: float, parts: list[str], env: dict) -> dict:
    """This invocation's part times merged into ``timings.json``: each part keeps its latest run's seconds
    (``parts_s``) and date (``parts_date``); ``last_run`` is this invocation."""
    old_path = out_dir / "timings.json"
    old = json.loads(old_path.read_text()) if old_path.exists() else {}
    old_date = old.get("environment", {}).get("date_utc")
    dates = {k: old.get("parts_date", {}).get(k, old_date) for k in old.get("parts_s", {})}
    return {
        "parts_s": {**old.get("parts_s", {}), **timings},
        "parts_date": {**dates, **dict.fromkeys(timings, env["date_utc"])},
        "last_run": {"parts": parts, "parts_s": timings, "total_s": total},
    }


if __name__ == "__main__":
    main()
