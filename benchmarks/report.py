"""Turn ``benchmarks/results/*.json`` into ``docs/benchmarks.md`` and its matplotlib PNGs.

``python -m benchmarks --only report`` regenerates the report from existing results without rerunning.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from benchmarks.common import ROOT  # noqa: E402
from benchmarks.study import epochs_to  # noqa: E402

DOCS = ROOT / "docs"
STYLE = {
    "baseline": ("black", "N = 1 baseline"),
    "adasum": ("tab:blue", "horovod_adasum, lr × 1"),
    "ddp_adasum": ("tab:purple", "ddp_adasum, lr × 1"),
    "adasum_x2": ("tab:cyan", "horovod_adasum, lr × 2"),
    "average_xN": ("tab:red", "horovod (average), lr × N"),
    "average_xsqrtN": ("tab:orange", "horovod (average), lr × √N"),
    "average_x1": ("tab:green", "horovod (average), lr × 1"),
}


def _load(directory: Path, name: str) -> dict | None:
    path = directory / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _fmt_epochs(values: list) -> str:
    return ", ".join("—" if v is None else str(v) for v in values)


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _group(runs: list[dict]) -> dict[tuple[int, str], list[dict]]:
    groups: dict[tuple[int, str], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["np"], r["method"]), []).append(r)
    return groups


def _method_order(key: tuple[int, str]) -> tuple[int, int, str]:
    n, method = key
    order = list(STYLE)
    return n, order.index(method) if method in order else len(order), method


def _scaling_rows(groups, target: float, lower: float) -> list[list]:
    rows = []
    for (n, method), rs in sorted(groups.items(), key=lambda item: _method_order(item[0])):
        rs = sorted(rs, key=lambda r: r["seed"])
        e_t = [epochs_to(r["history"], target)[0] for r in rs]
        s_t = [epochs_to(r["history"], target)[1] for r in rs]
        e_l = [epochs_to(r["history"], lower)[0] for r in rs]
        final = [r["history"][-1]["val_acc"] for r in rs]
        diverged = [bool(r.get("diverged") or r["history"][-1].get("diverged")) for r in rs]
        best = [max(h["val_acc"] for h in r["history"]) for r in rs]
        mark = " (best avg)" if rs[0].get("best_average") else ""
        rows.append(
            [
                n,
                STYLE.get(method, (None, method))[1] + mark,
                f"{rs[0]['factor']:.3g}",
                ", ".join(str(r["seed"]) for r in rs),
                _fmt_epochs(e_t),
                _fmt_epochs(s_t),
                _fmt_epochs(e_l),
                ", ".join(
                    f"{a:.4f}" + (" (diverged)" if d else "") for a, d in zip(final, diverged, strict=True)
                ),
                ", ".join(f"{a:.4f}" for a in best),
            ]
        )
    return rows


SCALING_HEADER = [
    "N",
    "method",
    "lr factor",
    "seeds",
    "epochs to {t}",
    "steps to {t}",
    "epochs to {l}",
    "final val_acc",
    "best val_acc",
]


def _accuracy_plot(
    runs: list[dict], sizes: list[int], path: Path, title: str, target: float, floor: float = 96.0
) -> None:
    """Validation accuracy (%) per epoch, one panel per N; values below ``floor`` are off the chart."""
    fig, axes = plt.subplots(1, len(sizes), figsize=(4 * len(sizes), 3.6), sharey=True, squeeze=False)
    for ax, n in zip(axes[0], sizes, strict=True):
        for r in (r for r in runs if r["np"] == n):
            color, label = STYLE.get(r["method"], ("gray", r["method"]))
            hist = r["history"]
            ax.plot(
                [h["epoch"] for h in hist],
                [100 * h["val_acc"] for h in hist],
                marker="s" if r["method"] == "ddp_adasum" else "o",
                markersize=4 if r["method"] == "ddp_adasum" else 6,
                color=color,
                linestyle="-" if r["seed"] == min(x["seed"] for x in runs) else "--",
                label=f"{label}, seed {r['seed']}",
            )
        ax.axhline(100 * target, color="gray", linewidth=0.8, linestyle=":")
        ax.set_title(f"N = {n}")
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(floor, 99.6)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation accuracy (%)")
    handles, labels = axes[0][-1].get_legend_handles_labels()
    for ax in axes[0][:-1]:
        h, lab = ax.get_legend_handles_labels()
        for hh, ll in zip(h, lab, strict=True):
            if ll not in labels:
                handles.append(hh)
                labels.append(ll)
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=7, bbox_to_anchor=(0.5, -0.02))
    fig.suptitle(f"{title} (below {floor:g}%: off the chart, see the tables)")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _epochs_plot(real: list[dict], sim: list[dict], path: Path, target: float, cap_real: int, cap_sim: int):
    """Epochs to ``target`` vs N: real processes (left) and simulated workers (right), mean over seeds.

    Methods are shifted a little sideways so that equal values stay visible; a run group in which some
    seed never reached the target is drawn as × above the cap. The N = 1 baseline starts every real line.
    """
    panels = [(p, r, c) for p, r, c in (("real processes", real, cap_real), ("simulated", sim, cap_sim)) if r]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), sharey=True, squeeze=False)
    order = list(STYLE)
    for ax, (title, runs, cap) in zip(axes[0], panels, strict=True):
        by = _group(runs)
        base = by.get((1, "baseline"), [])
        for method in sorted({m for _, m in by if m != "baseline"}, key=order.index):
            color, label = STYLE.get(method, ("gray", method))
            shift = 2 ** (0.06 * (order.index(method) - 2.5))
            groups = ([(1, base)] if base else []) + sorted(
                (n, rs) for (n, m), rs in by.items() if m == method
            )
            xs, ys, missing = [], [], []
            for n, rs in groups:
                vals = [epochs_to(r["history"], target)[0] for r in rs]
                if all(v is not None for v in vals):
                    xs.append(n * shift)
                    ys.append(statistics.mean(vals))
                else:
                    missing.append(n * shift)
            ax.plot(xs, ys, marker="s" if method == "ddp_adasum" else "o", color=color, label=label)
            if missing:
                ax.scatter(missing, [cap + 0.5] * len(missing), marker="x", color=color, s=60)
        ax.axhline(cap + 0.25, color="gray", linewidth=0.6, linestyle=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("workers N (per-worker batch fixed)")
        ax.set_title(f"{title} (cap {cap} epochs)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    axes[0][0].set_ylabel(f"epochs to {100 * target:.1f}% (mean over seeds)")
    axes[0][0].yaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(f"Epochs to {100 * target:.1f}% validation accuracy (× above the line: not reached)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(directory: Path, quick: bool = False) -> Path:
    """Write the Markdown report (and PNGs) from the results in ``directory``; returns its path."""
    out_md = directory / "report.md" if quick else DOCS / "benchmarks.md"
    fig_dir = directory if quick else DOCS
    prefix = "" if quick else "benchmarks_"
    fig_dir.mkdir(parents=True, exist_ok=True)
    real = _load(directory, "study_real")
    sim = _load(directory, "study_simulated")
    val = _load(directory, "simulator_validation")
    over = _load(directory, "overhead")
    thr = _load(directory, "throughput")
    ared = _load(directory, "allreduce")
    mem = _load(directory, "memory")
    loops = _load(directory, "loops")
    timings = _load(directory, "timings")
    cfg = (real or sim or {}).get("config", {})
    target, lower = cfg.get("target", 0.99), cfg.get("lower_target", 0.985)
    t, lt = f"{100 * target:.1f}%", f"{100 * lower:.1f}%"
    env = (real or sim or over or {}).get("environment", {})
    md = [
        "# Benchmarks: Adasum vs averaging, simulated workers, overhead" + (" (quick run)" if quick else ""),
        "",
        "Generated by `make bench` (" + ("`make bench-quick`, reduced" if quick else "full") + ") with "
        "`benchmarks/` from the raw results in `benchmarks/results/"
        + ("quick/" if quick else "")
        + "*.json` (every run's per-epoch history, command line, seeds, versions and machine). Regenerate "
        "the text and figures from those files with `python -m benchmarks --only report`.",
        "",
        f"Machine: {env.get('cpu_model', '?')}, {env.get('cpu_count', '?')} cores (shared with other work: "
        "timings are noisy, so ratios are measured side by side in one run), "
        f"{round(env.get('mem_total_kb', 0) / 2**20)} GiB; Python {env.get('python')}, "
        f"torch {env.get('torch')}, "
        f"pytorch-lightning {env.get('pytorch_lightning')}, Horovod {env.get('horovod')}, "
        f"{env.get('mpirun')}; {env.get('date_utc')}.",
        "",
    ]
    if timings:
        md += _timings_lines(timings)

    # ------------------------------------------------------------------ real study
    if real:
        md += [
            "## 1. Statistical efficiency on real MNIST (real processes)",
            "",
            "Model: the example's standard CNN (`MNISTNet`: conv 10, conv 20, fc 50, fc 10; "
            "21,840 parameters) "
            "**without dropout** (`benchmarks/common.py:BenchNet`, so that simulated and real runs can be "
            f"compared exactly). Per-process batch {cfg['batch_size']}, SGD momentum 0.9, linear one-cycle "
            "schedule (`OneCycleLR`, 18% warm-up from lr/25 to the peak, then linear down to lr/25000, no "
            f"momentum cycling) over the epoch cap of **{cfg['epochs']} epochs**, stepped every optimizer "
            "step (so its length in steps is cap × steps per epoch at that N). Training on the 60k split, "
            "validation on the 10k test split after every epoch; a run stops at the first epoch whose "
            f"validation accuracy reaches {t}. Ranks: `horovodrun -np N` on this machine (more processes "
            "than cores for N = 4, 8; `--mca mpi_yield_when_idle 1`, one thread per process); `ddp_adasum` "
            "rows: one plain `python` process with `--devices N`, Lightning's launcher starting the others "
            "(Gloo; one thread per process).",
            "",
            "### Baseline grid (1 process, seed " + str(cfg["seeds"][0]) + ")",
            "",
        ]
        rows = []
        for g in real["grid"]:
            e, s = epochs_to(g["history"], target)
            el, _ = epochs_to(g["history"], lower)
            rows.append(
                [
                    f"{g['lr']:g}",
                    "—" if e is None else e,
                    "—" if s is None else s,
                    "—" if el is None else el,
                    ", ".join(f"{h['val_acc']:.4f}" for h in g["history"]),
                    "**winner**" if g["lr"] == real["baseline_lr"] else "",
                ]
            )
        md += [
            _table(
                ["peak lr", f"epochs to {t}", f"steps to {t}", f"epochs to {lt}", "val_acc per epoch", ""],
                rows,
            ),
            "",
            f"Winner (fewest epochs to {t}, then highest accuracy): **peak lr {real['baseline_lr']:g}**. "
            "This learning rate is used unchanged by every `horovod_adasum` run; averaging multiplies it by "
            "the factor shown.",
            "",
            "### Scaling: N = " + ", ".join(str(n) for n in cfg["sizes"]),
            "",
            "Averaging: lr × N over all seeds; lr × 1 and × √N on the first seed; the best of the three "
            "(fewest epochs to the target, then accuracy) is repeated on the other seeds. "
            "`—` = not reached within the cap.",
            "",
            _table(
                [h.format(t=t, l=lt) for h in SCALING_HEADER],
                _scaling_rows(_group(real["runs"]), target, lower),
            ),
            "",
            f"![accuracy vs epoch]({prefix}accuracy_real.png)",
            "",
        ]
        md += _ddp_study_section(real, target)
        _accuracy_plot(
            real["runs"],
            cfg["sizes"],
            fig_dir / f"{prefix}accuracy_real.png",
            "Validation accuracy per epoch, real processes",
            target,
        )

    # ------------------------------------------------------------------ simulated
    if val:
        md += [
            "## 2. Simulated workers (`benchmarks/simulate.py`)",
            "",
            "### Validation against real Horovod",
            "",
            f"Same model, seed, data order and recipe as the study; real `horovodrun` jobs stop after "
            f"{val['cases'][0]['steps']} optimizer steps and rank 0's parameters are compared with the "
            "simulator's. Tolerance (also asserted by `tests/test_simulate.py` on a small model): 1e-5 of "
            "the largest parameter magnitude.",
            "",
            _table(
                [
                    "N",
                    "method",
                    "steps",
                    "max abs difference",
                    "relative to max |θ|",
                    "real job s",
                    "simulated s",
                ],
                [
                    [
                        c["np"],
                        c["method"],
                        c["steps"],
                        f"{c['max_abs_diff']:.3g}",
                        f"{c['max_rel_diff']:.3g}",
                        f"{c['real_job_wall_s']:.0f}",
                        f"{c['simulate_s']:.0f}",
                    ]
                    for c in val["cases"]
                ],
            ),
            "",
        ]
    if sim:
        scfg = sim["config"]
        md += [
            "### Epochs to the target, N = " + ", ".join(str(n) for n in scfg["sim_sizes"]) + " (simulated)",
            "",
            f"Same recipe (peak lr {sim['baseline_lr']:g}, one-cycle over the cap of {scfg['sim_epochs']} "
            f"epochs at that N), seeds {scfg['sim_seeds']}. Adasum lr × 1 (and × 2 on the first seed: "
            "Horovod's Adasum guide suggests 2–2.5× on CPU); averaging lr × √N (and × N on the first seed). "
            "A run stops when its training loss is no longer finite (diverged).",
            "",
            _table(
                [h.format(t=t, l=lt) for h in SCALING_HEADER],
                _scaling_rows(_group(sim["runs"]), target, lower),
            ),
            "",
        ]
        _accuracy_plot(
            sim["runs"],
            scfg["sim_sizes"],
            fig_dir / f"{prefix}accuracy_simulated.png",
            "Validation accuracy per epoch, simulated workers",
            target,
            floor=90.0,
        )
        md += ["![simulated accuracy](" + f"{prefix}accuracy_simulated.png)", ""]
    if real or sim:
        for tgt, name in ((target, "epochs_to_target"), (lower, "epochs_to_lower_target")):
            _epochs_plot(
                real["runs"] if real else [],
                sim["runs"] if sim else [],
                fig_dir / f"{prefix}{name}.png",
                tgt,
                cfg.get("epochs", 0),
                (sim or {}).get("config", cfg).get("sim_epochs", 0),
            )
            md += [f"![epochs to target]({prefix}{name}.png)", ""]

    # ------------------------------------------------------------------ overhead
    if over or thr:
        md += ["## 3. Overhead and cost", ""]
    if thr:
        md += [
            "### Throughput: `ddp_adasum` vs `horovod_adasum`",
            "",
            "The same training through Lightning with each strategy: model (the example's `MNISTNet`, with "
            "dropout), batch 64 per process, data (the example's `MNISTDataModule`, per-image torchvision "
            "transforms, a `DistributedSampler` shard per rank, the same shuffling seed), SGD lr 0.01 "
            "momentum 0.5, one epoch, steps/s of rank 0 from step 10 to the end of the epoch "
            "(`benchmarks/throughput.py`). `ddp_adasum` is launched as users launch it: one plain `python` "
            "process with `devices=N`, Lightning's launcher starting the others (Gloo); `horovod_adasum` "
            "under `horovodrun -np N` (MPI, `--mca mpi_yield_when_idle 1`, and its Gloo group beside "
            "Horovod). One thread per process. Runs alternate ddp, hvd, hvd, ddp, ddp, hvd, … per N; "
            "the ratios are ddp_adasum / horovod_adasum: of the medians, the median of the ratios of "
            "back-to-back pairs (each pair shares the machine's load of the moment), and of the best runs "
            "(the least disturbed by other work). CPU ms per step and process: median over runs and ranks of "
            "`time.process_time()` (all threads of the process, Horovod's background thread included) over "
            "the timed steps.",
            "",
            _table(
                [
                    "N",
                    "ddp_adasum steps/s (median)",
                    "horovod_adasum steps/s (median)",
                    "ratio of medians",
                    "median of pair ratios",
                    "ratio of best runs",
                    "ratio per pair",
                    "ddp_adasum steps/s, each run",
                    "horovod_adasum steps/s, each run",
                    "CPU ms per step and process, ddp / hvd",
                ],
                [
                    [
                        s_["np"],
                        f"{s_['ddp_adasum_steps_per_s_median']:.1f}",
                        f"{s_['lightning_steps_per_s_median']:.1f}",
                        f"**{s_['ratio_of_medians']:.3f}**",
                        _opt(s_, "median_of_pair_ratios"),
                        _opt(s_, "ratio_of_best"),
                        ", ".join(f"{x:.3f}" for x in s_["ratio_per_pair"]),
                        ", ".join(f"{x:.1f}" for x in s_["ddp_adasum_steps_per_s"]),
                        ", ".join(f"{x:.1f}" for x in s_["lightning_steps_per_s"]),
                        _cpu_pair(s_, "ddp_adasum", "lightning"),
                    ]
                    for s_ in thr["summary"]
                ],
            ),
            "",
        ]
    if over:
        md += [
            "### Lightning + `horovod_adasum` vs a raw Horovod loop",
            "",
            "Same processes, model (the example's `MNISTNet`, with dropout), batch 64 per process, data (the "
            "example's `MNISTDataModule`, per-image torchvision transforms, a `DistributedSampler` shard per "
            "rank), SGD lr 0.01 momentum 0.5, `op=hvd.Adasum`; one epoch; steps/s of rank 0 from step 10 to "
            "the end of the epoch. Runs alternate Lightning, raw, Lightning, raw, … "
            "(`benchmarks/throughput.py`). The strategy runs a Gloo process group beside Horovod for "
            "Lightning's own collectives (among them Lightning's per-step SIGTERM broadcast); the raw loop "
            "has none. Ratios and CPU time as in the table above.",
            "",
            _table(
                [
                    "N",
                    "Lightning steps/s (median)",
                    "raw steps/s (median)",
                    "ratio of medians",
                    "median of pair ratios",
                    "ratio of best runs",
                    "ratio per pair",
                    "Lightning steps/s, each run",
                    "raw steps/s, each run",
                    "CPU ms per step and process, Lightning / raw",
                ],
                [
                    [
                        s["np"],
                        f"{s['lightning_steps_per_s_median']:.1f}",
                        f"{s['raw_steps_per_s_median']:.1f}",
                        f"**{s['ratio_of_medians']:.3f}**",
                        _opt(s, "median_of_pair_ratios"),
                        _opt(s, "ratio_of_best"),
                        ", ".join(f"{x:.3f}" for x in s["ratio_per_pair"]),
                        ", ".join(f"{x:.1f}" for x in s.get("lightning_steps_per_s", [])),
                        ", ".join(f"{x:.1f}" for x in s.get("raw_steps_per_s", [])),
                        _cpu_pair(s, "lightning", "raw"),
                    ]
                    for s in over["summary"]
                ],
            ),
            "",
        ]
        if over.get("summary_without_sigterm_broadcast"):
            md += [
                "Diagnostic, measured in the same run (a third run after each pair): Lightning + "
                "`horovod_adasum` without Lightning's per-step SIGTERM broadcast "
                "(`_TrainingEpochLoop._broadcast_sigterm_tensor` replaced by a no-op; such a job would not "
                "stop all ranks at the same step after a SIGTERM), against the same raw runs:",
                "",
                _table(
                    [
                        "N",
                        "without broadcast, steps/s (median)",
                        "ratio of medians to raw",
                        "ratio per run (to the raw run before it)",
                        "CPU ms per step and process, without broadcast / raw",
                    ],
                    [
                        [
                            s["np"],
                            f"{s['lightning_no_sigterm_broadcast_steps_per_s_median']:.1f}",
                            f"**{s['ratio_of_medians']:.3f}**",
                            ", ".join(f"{x:.3f}" for x in s["ratio_per_pair"]),
                            _cpu_pair(s, "lightning_no_sigterm_broadcast", "raw"),
                        ]
                        for s in over["summary_without_sigterm_broadcast"]
                    ],
                ),
                "",
            ]
    if ared:
        md += ["### Allreduce time: Adasum vs Average vs Sum (float32, CPU, MPI)", ""]
        for job in ared["jobs"]:
            rows = []
            for r in job["results"]:
                size = r["size_bytes"]
                label = f"{size // 2**20} MB" if size >= 2**20 else f"{size // 2**10} KB"
                m = r["median_s"]
                rows.append(
                    [
                        label,
                        r["rounds"],
                        f"{1e3 * m['Adasum']:.3f}",
                        f"{1e3 * m['Average']:.3f}",
                        f"{1e3 * m['Sum']:.3f}",
                        f"**{r['adasum_over_average']:.2f}**",
                        f"{r['adasum_over_sum']:.2f}",
                    ]
                )
            md += [
                f"{job['world_size']} processes (`benchmarks/allreduce.py`, median of interleaved rounds):",
                "",
                _table(
                    ["size", "rounds", "Adasum ms", "Average ms", "Sum ms", "Adasum/Average", "Adasum/Sum"],
                    rows,
                ),
                "",
            ]
        _allreduce_plot(ared, fig_dir / f"{prefix}allreduce.png")
        md += [f"![allreduce ratio]({prefix}allreduce.png)", ""]
    if ared and ared.get("adasum_allreduce_jobs"):
        md += _adasum_allreduce_section(ared["adasum_allreduce_jobs"])
    if mem:
        md += [
            "### Peak memory per process (RSS)",
            "",
            "The example (`examples/mnist.py fit --config examples/mnist.yaml`, 1 epoch limited to "
            f"{mem['config']['memory_batches']} batches) under each strategy; `ru_maxrss` of every rank "
            "after `fit` (`benchmarks/rss_example.py`); `ddp_adasum` started by Lightning "
            "(`--trainer.devices=N`), the others under `horovodrun`. Horovod's Adasum optimizer keeps one "
            "extra copy of the parameters between steps, `ddp_adasum` one too (with the reduction's receive "
            "buffer, half a copy): 21,840 float32 = 87,360 bytes = 85 KiB for this model.",
            "",
            _table(
                ["N", "strategy", "peak RSS per rank (MiB)", "mean (MiB)"],
                [
                    [
                        r["np"],
                        r["strategy"],
                        ", ".join(f"{k / 1024:.0f}" for k in r["peak_rss_kb_per_rank"]),
                        f"{statistics.mean(r['peak_rss_kb_per_rank']) / 1024:.1f}",
                    ]
                    for r in mem["runs"]
                ],
            ),
            "",
        ]
    if loops:
        md += _loops_section(loops)
    local_sgd_throughput = _load(directory, "local_sgd_throughput")
    if local_sgd_throughput:
        md += _local_sgd_throughput_section(local_sgd_throughput)
    local_sgd = _load(directory, "local_sgd")
    if local_sgd:
        md += _local_sgd_section(local_sgd, fig_dir)
    fsdp_memory = _load(directory, "fsdp_memory")
    if fsdp_memory:
        md += _fsdp_memory_section(fsdp_memory)
    elastic = _load(directory, "elastic_study")
    if elastic:
        md += _elastic_study_section(elastic)
    slow_link = _load(directory, "slow_link")
    if slow_link:
        md += _slow_link_section(slow_link, fig_dir / f"{prefix}slow_link.png")
    path = out_md
    text = "\n".join(md) + "\n"
    notes = DOCS / "benchmarks_notes.md"
    if not quick and notes.exists():
        text += "\n" + notes.read_text()
    path.write_text(text)
    return path


#: ``loops`` ratio rows, in the order shown, with what each answers.
_LOOPS_ROWS = (
    ("fabric_adasum/plain_adasum", "Fabric `ddp_adasum` / plain loop with `AdasumOptimizer` (goal ≥ 0.95)"),
    ("trainer_adasum/plain_adasum", "Trainer `ddp_adasum` / plain loop with `AdasumOptimizer`"),
    ("trainer_ddp/plain_ddp", "Trainer `ddp` / plain DDP loop (the Trainer's own overhead, for comparison)"),
    ("plain_adasum/plain_ddp", "plain Adasum loop / plain DDP loop"),
    ("trainer_adasum/trainer_ddp", "Trainer `ddp_adasum` / Trainer `ddp`"),
    ("trainer_adasum_overlap/trainer_ddp", "Trainer `ddp_adasum(overlap_backward=True)` / Trainer `ddp`"),
    ("trainer_adasum_overlap/trainer_adasum", "Trainer `ddp_adasum`: bucket by bucket during backward / the "
     "whole step after it"),
    ("trainer_horovod_adasum/trainer_ddp", "Trainer `horovod_adasum` (under `horovodrun`) / Trainer `ddp`"),
    ("trainer_adasum/trainer_horovod_adasum", "Trainer `ddp_adasum` / Trainer `horovod_adasum`"),
    ("trainer_adasum_iterable/trainer_adasum", "iterable loader / sized loader under `ddp_adasum` (the "
     "uneven-inputs agreement: one small all_reduce per step)"),
    ("plain_adasum_backward/plain_adasum", "plain loop: bucket by bucket during backward "
     "(`BackwardAdasumStep`) / the whole step after it (`AdasumOptimizer`)"),
    ("plain_adasum_backward/plain_ddp", "the same / plain DDP loop"),
    ("plain_adasum/plain_local", "plain Adasum loop / its local steps with no reduction (what the Adasum "
     "allreduce costs end to end)"),
    ("plain_ddp/plain_local", "plain DDP loop / the same local steps with no reduction (what DDP's "
     "allreduce costs, overlap included)"),
)  # fmt: skip


def _loops_section(loops: dict) -> list[str]:
    """The three forms of ``ddp_adasum`` beside DDP: steps/s, ratios per round, memory, reduction time."""
    md = [
        "## Training loops",
        "",
        "The same training in each form (`benchmarks/loops.py`): a plain `torch.distributed` loop with "
        "`DistributedDataParallel` (`plain_ddp`), with `AdasumOptimizer` (`plain_adasum`), stepping and "
        "reducing bucket by bucket during backward (`plain_adasum_backward`, "
        "`adasum_lightning.step.BackwardAdasumStep`) or with no reduction at all "
        "(`plain_local`: the compute every form pays), all under "
        '`torchrun`; `Fabric(strategy="ddp_adasum")` (`fabric_adasum`); `Trainer(strategy="ddp")` '
        '(`trainer_ddp`) and `Trainer(strategy="ddp_adasum")` (`trainer_adasum`; '
        "`trainer_adasum_overlap` with `overlap_backward=True`; `trainer_adasum_iterable` with an "
        '`IterableDataset`), Lightning\'s launcher; `Trainer(strategy="horovod_adasum")` under '
        "`horovodrun` (`trainer_horovod_adasum`). Bucket by bucket during backward, the reduction time is "
        "what is left to wait for after backward. Models: the example's "
        "CNN (21,840 parameters) and an MLP 784 → 4 × 2048 → 10 (14.2 M parameters, 57 MB); synthetic "
        "MNIST-shaped data in memory, batch 64 per process, SGD lr 0.01 momentum 0.9, Gloo, one thread per "
        "process. "
        "Steps/s of rank 0 after 5 warm-up steps. Each round runs every form once (the order rotated each "
        "round); a ratio is taken within a round, and the table gives the median of the rounds with their "
        "range. N above the 2 cores is oversubscribed: those rows measure contention as much as the code.",
        "",
    ]
    for row in loops["summary"]:
        over = " (oversubscribed: more processes than cores)" if row["oversubscribed"] else ""
        md += [f"### {row['model'].upper()}, N = {row['np']}{over}", ""]
        md.append(
            _table(
                ["form", "steps/s (rounds)", "reduction ms/step (median)", "peak RSS per process (MiB, max)"],
                [
                    [
                        impl,
                        ", ".join(f"{v:.1f}" for v in row[impl]["steps_per_s"]),
                        f"{row[impl]['reduction_ms_per_step_median']:.1f}",
                        f"{row[impl]['peak_rss_mb_max']:.0f}",
                    ]
                    for impl in row
                    if isinstance(row[impl], dict) and "steps_per_s" in row[impl]
                ],
            )
        )
        md += [
            "",
            _table(
                ["ratio", "median", "range", "what"],
                [
                    [key, f"{row[key]['median']:.3f}", f"{row[key]['min']:.3f}–{row[key]['max']:.3f}", what]
                    for key, what in _LOOPS_ROWS
                    if key in row
                ],
            ),
            "",
        ]
    return md


def _spread(stat: dict, digits: int = 2) -> str:
    return f"{stat['median']:.{digits}f} [{stat['min']:.{digits}f}, {stat['max']:.{digits}f}]"


def _local_sgd_throughput_section(result: dict) -> list[str]:
    """Part ``local_sgd_throughput``: the Trainer's ``ddp_adasum`` every step and with ``sync_every=10``
    beside Lightning's ``ddp``: steps/s, the ratios per round, bytes handed to the reduction per sample."""
    md = [
        "## Local SGD: steps/s (part `local_sgd_throughput`)",
        "",
        '`Trainer(strategy="ddp")` (`trainer_ddp`), `Trainer(strategy="ddp_adasum")` every step '
        "(`trainer_adasum`) and `DDPAdasumStrategy(sync_every=10)` (`trainer_adasum_sync10`: 10 local steps, "
        "then the Adasum of the pseudo-gradients) on the MLP of the training loops (57 MB), Lightning's "
        "launcher, Gloo, one thread per process (`benchmarks/loops.py`). Each round runs the three once; a "
        "ratio is taken within a round: median [min, max] of the rounds. Bytes per sample: what each rank "
        "hands to the reduction per training sample (`sync_every=10`: one pseudo-gradient per 10 steps).",
        "",
    ]
    for row in result["summary"]:
        md += [f"### {row['model'].upper()}, N = {row['np']}", ""]
        impls = [k for k in row if isinstance(row[k], dict) and "steps_per_s" in row[k]]
        md.append(
            _table(
                [
                    "form",
                    "steps/s (rounds)",
                    "reduction ms/step (median)",
                    "bytes per sample",
                    "peak RSS (MiB)",
                ],
                [
                    [
                        impl,
                        ", ".join(f"{v:.2f}" for v in row[impl]["steps_per_s"]),
                        f"{row[impl]['reduction_ms_per_step_median']:.1f}",
                        f"{row[impl].get('reduced_bytes_per_sample_median', 0):,.0f}",
                        f"{row[impl]['peak_rss_mb_max']:.0f}",
                    ]
                    for impl in impls
                ],
            )
        )
        ratios = [k for k in row if "/" in k and isinstance(row[k], dict)]
        md += [
            "",
            _table(["ratio", "median [min, max] of the rounds"], [[k, _spread(row[k], 3)] for k in ratios]),
            "",
        ]
    return md


def _local_sgd_section(result: dict, fig_dir: Path) -> list[str]:
    """Part ``local_sgd``: the study's tables and figures (``benchmarks/local_sgd.py``; the reading of them
    is docs/local_sgd.md)."""
    from benchmarks.local_sgd import forms_tables, tables

    cfg = result["config"]
    figures = sorted(p.name for p in fig_dir.glob("local_sgd_*.png"))
    md = [
        "## Local SGD and DiLoCo: Adasum vs averaging of the pseudo-gradients (part `local_sgd`)",
        "",
        "N workers simulated in one process (checked equal to real ranks at N = 2 and 4), H inner steps per "
        "outer round, each combination at its own best outer learning rate of a grid; per model (N, H, "
        "inner optimizers, seeds): "
        + "; ".join(
            f"{m} ({cfg[m]['sizes']}, {cfg[m]['sync_every']}, {', '.join(cfg[m]['inners'])}, "
            f"{len(cfg[m]['seeds'])} seeds)"
            for m in cfg["models"]
        )
        + " (`benchmarks/local_sgd.py`). The method, the reading and what was shrunk: "
        "[local_sgd.md](local_sgd.md).",
        "",
        *(line for name in figures for line in (f"![{name.removesuffix('.png')}]({name})", "")),
        tables(result),
        "",
        "The aim (N = 16, H = 50: Adasum reaches averaging's final validation loss in ≤ 0.8 of its outer "
        "rounds), per model, inner optimizer and method (fraction of rounds per seed; None: not reached):",
        "",
        _table(
            ["model", "inner", "method", "fraction per seed", "held"],
            [
                [
                    a["model"],
                    a["inner"],
                    a["method"],
                    ", ".join("—" if f is None else f"{f:.2f}" for f in a["fraction_per_seed"]),
                    a["held"],
                ]
                for a in result.get("aim", [])
            ],
        ),
        "",
    ]
    if result.get("forms_summary"):
        md += [
            "`overlap_sync` (each outer update applied one round late) and a bfloat16 wire, each combination "
            "at its searched outer lr (reading: [local_sgd.md](local_sgd.md)):",
            "",
            forms_tables(result),
            "",
        ]
    return md


def _fsdp_memory_section(result: dict) -> list[str]:
    """Part ``fsdp_memory``: peak memory per rank and step time of ``fsdp_adasum`` beside Lightning's HSDP."""
    md = [
        "## `fsdp_adasum`: memory per rank (part `fsdp_memory`)",
        "",
        "`FSDPAdasumStrategy(shard_size=S)` beside Lightning's `ModelParallelStrategy` as HSDP (replicate × "
        "shard, the gradients averaged) on the same mesh, the MLP of the training loops (57 MB), SGD with "
        "momentum, Gloo, one thread per process (`benchmarks/fsdp_memory.py`). Peak RSS while training, the "
        "largest rank's; median [min, max] of the rounds. More processes than cores: the step times measure "
        "contention as much as the code.",
        "",
    ]
    summary = result["summary"]
    for row in summary if isinstance(summary, list) else [summary]:
        over = " (oversubscribed)" if row.get("oversubscribed") else ""
        md += [f"### N = {row['np']}, shard size {row['shard_size']}{over}", ""]
        rows = [
            [
                impl,
                _spread(row[impl]["training_peak_rss_mb_max_rank"], 0),
                _spread(row[impl]["ms_per_step"], 0),
            ]
            for impl in ("fsdp_adasum", "hsdp")
            if impl in row
        ]
        md.append(_table(["form", "training peak RSS (MiB)", "ms per step"], rows))
        md += [
            "",
            f"- fsdp_adasum − HSDP, training peak: {_spread(row['training_peak_difference_mb'], 0)} MiB; one "
            f"shard of the parameters: {row['parameter_shard_mb']:.1f} MiB; step time ratio "
            f"{_spread(row['step_time_ratio'])}.",
        ]
        for key, value in row.items():
            if key.startswith(("step_buffer", "float64_scratch")):
                shown = f"{value:.1f}" if isinstance(value, float) else value
                md.append(f"- {key.replace('_', ' ').replace(' mb ', ' (MiB) ')}: {shown}")
        md.append("")
    return md


#: ``elastic_study``'s runs, as the report names them.
_ELASTIC_LABELS = {
    "adasum_elastic": "Adasum (`ddp_adasum`), lr × 1",
    "adasum_4": "Adasum (`ddp_adasum`), lr × 1",
    "average_elastic": "averaging, lr × 4 kept",
    "average_4": "averaging, lr × 4",
}


def _elastic_study_rows(result: dict) -> list[list[str]]:
    """Part ``elastic_study``'s table rows: run, world per epoch, final val_acc (%) and val_loss, each as
    mean ± standard deviation over the seeds with [min, max]."""
    rows = []
    for row in result["summary"]:
        acc = {k: 100 * v for k, v in row["val_acc"].items() if k != "values"}
        loss = row["val_loss"]
        rows.append(
            [
                _ELASTIC_LABELS[row["run"]],
                " → ".join(str(w) for w in row["world_sizes"]),
                f"{acc['mean']:.2f} ± {acc['std']:.2f} [{acc['min']:.2f}, {acc['max']:.2f}]",
                f"{loss['mean']:.4f} ± {loss['std']:.4f} [{loss['min']:.4f}, {loss['max']:.4f}]",
            ]
        )
    return rows


def _elastic_study_section(result: dict) -> list[str]:
    """Part ``elastic_study``: the final validation accuracy and loss of the simulated elastic runs."""
    cfg = result["config"]
    schedule = " → ".join(str(w) for w in cfg["elastic_schedule"])
    seeds = ", ".join(str(s) for s in cfg["elastic_seeds"])
    return [
        f"## A world that shrinks and grows: {schedule} ranks (part `elastic_study`, simulated)",
        "",
        f"The study's MNIST model and recipe (batch {cfg['batch_size']} per rank, SGD momentum 0.9, "
        f"one-cycle to lr {result['baseline_lr']:g}), {len(cfg['elastic_schedule'])} epochs simulated "
        "(`benchmarks/simulate.py`, `benchmarks/elastic_study.py`) with the world size changing between "
        "epochs; each run beside its uninterrupted run at the first world size. At a change the parameters "
        "carry on and new rank r takes old rank r mod W's optimizer and scheduler state; the one-cycle "
        "schedule spans the steps each run takes. Averaging keeps the lr × 4 it was tuned with at 4 ranks. "
        f"Final epoch; mean ± standard deviation [min, max] over seeds {seeds}.",
        "",
        _table(["run", "ranks per epoch", "val_acc (%)", "val_loss"], _elastic_study_rows(result)),
        "",
        "Elastic − uninterrupted, per seed (" + seeds + "): " + "; ".join(_elastic_differences(result)) + ".",
        "",
    ]


def _elastic_differences(result: dict) -> list[str]:
    """Per method and seed, elastic minus uninterrupted: final val_acc (points) and val_loss."""
    runs = {(r["run"], r["seed"]): r for r in result["runs"]}
    seeds = result["config"]["elastic_seeds"]
    parts = []
    for method, label in (("adasum", "Adasum"), ("average", "averaging")):
        pairs = [(runs[(f"{method}_elastic", s)], runs[(f"{method}_4", s)]) for s in seeds]
        acc = ", ".join(f"{100 * (e['val_acc'] - u['val_acc']):+.2f}" for e, u in pairs)
        loss = ", ".join(f"{e['val_loss'] - u['val_loss']:+.4f}" for e, u in pairs)
        parts.append(f"{label} val_acc {acc} points, val_loss {loss}")
    return parts


def _ddp_study_section(real: dict, target: float) -> list[str]:
    """``ddp_adasum`` vs ``horovod_adasum`` per N and seed (same lr, recipe, data order and seed)."""
    by = {(r["np"], r["method"], r["seed"]): r for r in real["runs"]}
    pairs = sorted((n, seed) for n, m, seed in by if m == "ddp_adasum")
    if not pairs:
        return []
    t = f"{100 * target:.1f}%"
    rows = []
    for n, seed in pairs:
        d, h = by[(n, "ddp_adasum", seed)], by.get((n, "adasum", seed))
        if h is None:
            continue
        ed, eh = epochs_to(d["history"], target)[0], epochs_to(h["history"], target)[0]
        diff = max(abs(a["val_acc"] - b["val_acc"]) for a, b in zip(d["history"], h["history"], strict=False))
        rows.append(
            [
                n,
                seed,
                "—" if eh is None else eh,
                "—" if ed is None else ed,
                "**same**" if eh == ed else "**differs**",
                f"{h['history'][-1]['val_acc']:.4f}",
                f"{d['history'][-1]['val_acc']:.4f}",
                f"{diff:.4f}",
                f"{h['train_s']:.0f}",
                f"{d['train_s']:.0f}",
            ]
        )
    md = [
        f"### `ddp_adasum` next to `horovod_adasum` (epochs to {t})",
        "",
        "Both with the baseline's learning rate unscaled (lr × 1), the same one-cycle schedule, data order "
        "and seeds; `horovod_adasum` under `horovodrun -np N`, `ddp_adasum` started by Lightning "
        "(`--devices N`). Run one after the other in the same session (`python -m benchmarks --only "
        "study_ddp`, or the whole study). Largest |Δ val_acc| over the epochs both ran; train s: time in "
        "the training epochs (noisy: shared machine).",
        "",
        _table(
            [
                "N",
                "seed",
                f"horovod_adasum epochs to {t}",
                f"ddp_adasum epochs to {t}",
                "",
                "horovod_adasum final val_acc",
                "ddp_adasum final val_acc",
                "max |Δ val_acc|",
                "horovod_adasum train s",
                "ddp_adasum train s",
            ],
            rows,
        ),
        "",
    ]
    superseded = {(r["np"], r["method"], r["seed"]): r for r in real.get("superseded_runs", [])}
    notes = []
    for (n, method, seed), old in sorted(superseded.items()):
        new = by.get((n, method, seed))
        if new is None:
            continue
        same = [h["val_acc"] for h in old["history"]] == [h["val_acc"] for h in new["history"]]
        notes.append(
            f"N = {n} seed {seed}: "
            + ("every epoch's val_acc identical" if same else "val_acc per epoch "
               + ", ".join(f"{h['val_acc']:.4f}" for h in old["history"]) + " then, "
               + ", ".join(f"{h['val_acc']:.4f}" for h in new["history"]) + " now")
        )  # fmt: skip
    if notes:
        date = (next(iter(superseded.values())).get("superseded_run_date") or "")[:10]
        md += [
            f"The `horovod_adasum` rows at these N were re-run with the current strategy code (they replace "
            f"the study's run of {date} in the scaling table above): " + "; ".join(notes) + ".",
            "",
        ]
    return md


def _cpu_pair(summary: dict, a: str, b: str) -> str:
    x, y = summary.get(f"{a}_cpu_ms_per_step_median"), summary.get(f"{b}_cpu_ms_per_step_median")
    return "—" if x is None or y is None else f"{x:.1f} / {y:.1f}"


def _opt(summary: dict, key: str) -> str:
    return f"{summary[key]:.3f}" if key in summary else "—"


def _timings_lines(timings: dict) -> list[str]:
    """Wall time per part; parts measured on different days (``--only``) carry their date."""
    parts_s = timings["parts_s"]
    dates = {k: (v or "")[:10] for k, v in timings.get("parts_date", {}).items()}
    if len(set(dates.values())) <= 1:
        total = timings.get("total_s", sum(parts_s.values()))
        parts = ", ".join(f"{k} {v / 60:.1f} min" for k, v in parts_s.items())
        return [f"Wall time of this run: **{total / 60:.1f} min** ({parts}).", ""]
    parts = ", ".join(f"{k} {v / 60:.1f} min ({dates.get(k, '?')})" for k, v in parts_s.items())
    return [
        f"Wall time of the parts, each from its latest run (date in brackets; `python -m benchmarks --only "
        f"PART` reruns one): {parts}; **{sum(parts_s.values()) / 60:.1f} min** in all.",
        "",
    ]


def _size_label(size: int) -> str:
    return f"{size // 2**20} MB" if size >= 2**20 else f"{size // 2**10} KB"


def _adasum_allreduce_section(jobs: list[dict]) -> list[str]:
    """Tables of ``benchmarks/adasum_allreduce.py``: ours (Gloo) vs Horovod's MPI Adasum vs Gloo's sum."""
    md = [
        "### Adasum allreduce on torch.distributed (Gloo) vs Horovod's MPI Adasum (float32, CPU)",
        "",
        "`adasum_lightning.allreduce.adasum_allreduce` over a Gloo process group created beside Horovod in "
        "the same processes, Horovod's in-place Adasum allreduce over MPI, and Gloo's own `all_reduce` (sum: "
        "the transport alone) on the same per-rank inputs, in interleaved rounds after a barrier "
        "(`benchmarks/adasum_allreduce.py`, medians).",
        "",
    ]
    for job in jobs:
        rows = []
        for r in job["results"]:
            m = r["median_s"]
            rows.append(
                [
                    _size_label(r["size_bytes"]),
                    r["rounds"],
                    f"{1e3 * m['ours']:.3f}",
                    f"{1e3 * m['horovod_adasum']:.3f}",
                    f"{1e3 * m['gloo_sum']:.3f}",
                    f"**{r['ours_over_horovod']:.2f}**",
                    f"{r['ours_over_gloo_sum']:.2f}",
                ]
            )
        md += [
            f"{job['world_size']} processes:",
            "",
            _table(
                [
                    "size",
                    "rounds",
                    "ours ms",
                    "Horovod Adasum ms",
                    "Gloo sum ms",
                    "ours/Horovod",
                    "ours/Gloo sum",
                ],
                rows,
            ),
            "",
        ]
        if "breakdown" in job:
            b = job["breakdown"]
            parts = ["exchange", "small_exchange", "dots_float64", "combine_float64", "other", "total"]
            md += [
                f"Where our time goes at {_size_label(b['size_bytes'])}, {job['world_size']} processes "
                f"(median of {b['rounds']} instrumented calls, ms): large messages (posting and waiting), "
                "the dot-product sums across ranks (with waiting for the partner), float64 dot products, "
                "float64 combination, the rest.",
                "",
                _table(parts, [[f"{1e3 * b['median_s'][k]:.2f}" for k in parts]]),
                "",
            ]
    return md


def _slow_link_section(result: dict, png: Path) -> list[str]:
    """Part ``slow_link``: steps/s per variant on a rate-limited link, the fraction of the ceiling and the
    target ratios per rig and rate; the training time to the target validation loss."""
    md = [
        "## A slow link (part `slow_link`)",
        "",
        "The MLP of the training loops (784 → 4 × 2048 → 10, 57 MB float32), SGD momentum 0.9, batch "
        "64 per rank, MNIST, N = 2, Gloo, one thread per process, on a rate-limited link "
        "(`benchmarks/slow_link.py`). Rig `loopback`: both ranks in one network namespace whose `lo` "
        "passes a token bucket (`tc qdisc add dev lo root tbf rate RATE burst 1mb latency 500ms`): "
        "both directions share it. Rig `two_hosts`: the emulated hosts of `tests/twohosts.py`, one "
        "rank each, a bucket on each end of their link (one per direction: twice the shared bucket's "
        "throughput). `post_local_sgd_10`: Lightning's `DDPStrategy(model_averaging_period=10)` with "
        "`post_localSGD_hook` registered by hand (`PostLocalSGDState`, one rank per subgroup, "
        "`start_localSGD_iter=1`; Lightning registers DDP hooks on CUDA only); `torchft_diloco_H`: "
        "torchft's `DiLoCo` (one fragment, `sync_every=H`, outer Nesterov SGD lr 0.1 momentum 0.9) with real "
        "`Manager`s (a replica group of one process per rank, torchft's lighthouse, `ProcessGroupGloo`): "
        "a plain torch loop in torchft's own environment (`benchmarks/slow_link_torchft.py`; torchft has "
        "no Lightning strategy), a second job of the round in the same rig; `ceiling`: "
        "`sync_every=1000`, no exchange in the timed steps. A round is one job (its own namespaces) "
        "fitting every variant once in the same processes, the order rotated each round; steps/s of "
        "rank 0 over the timed steps (warm-up and timed steps by the variant's period: "
        + ", ".join(f"H = {h}: {a} + {b}" for h, (a, b) in result["config"]["steps"].items())
        + "; whole windows, so the timed steps hold timed / H exchanges; two warm-up windows at H = 10 and "
        "50, because with `overlap_sync` the first exchange, which pays the first-use costs, lands at the "
        "end of the second). Fraction of the ceiling and ratios: within each round, median [min, max] of "
        "the rounds.",
        "",
    ]
    if result.get("unavailable"):
        return [*md, f"Not run: {result['unavailable']}.", ""]
    for block in result["blocks"]:
        summary = block["summary"]
        md += [f"### {block['rig']}, {block['rate']}, {block['rounds']} rounds", ""]
        md.append(
            _table(
                ["variant", "strategy, keyword arguments", "steps/s", "fraction of the ceiling"],
                [
                    [
                        v,
                        _kwargs_label(block["runs"], v),
                        _spread(row["steps_per_s"]),
                        _spread(row["fraction_of_ceiling"]) if "fraction_of_ceiling" in row else "",
                    ]
                    for v, row in summary["variants"].items()
                ],
            )
        )
        md += [""]
        md += [
            _table(
                ["ratio (per round)", "numerator", "median [min, max]", "target"],
                [
                    [
                        key,
                        r["numerator"],
                        _spread(r, 3),
                        ""
                        if r["target"] is None
                        else f"≥ {r['target']}: {'met' if r['median'] >= r['target'] else 'not met'}",
                    ]
                    for key, r in summary["ratios"].items()
                ],
            ),
            "",
        ]
        md += [f"Not run here: `{v}`: {why}." for v, why in block.get("skipped", {}).items()]
        md += [""] if block.get("skipped") else []
    _slow_link_plot(result["blocks"], png)
    md += [f"![steps/s on a slow link]({png.name})", ""]
    target = result.get("target")
    if target:
        md += [
            f"### Training time to validation loss {target['target_loss']} ({target['rate']}, loopback)",
            "",
            (
                "Inner lr {lr}; every {every} steps after the variant's syncs (post-local SGD: 2 "
                "steps later, after its averaging) each rank's model is evaluated on the first {n} "
                "images of MNIST's test split, and the loss is averaged over the ranks. Training "
                "time: from the first step's start to the end of the step that reached the target, "
                "the evaluations left out (process start, set-up and the end of fit too). Lightning "
                "`ddp` runs first; each other variant stops at `ddp`'s time (not reached by then: not"
                " faster). Then post-local SGD and the fastest `sync_every=10` settings of the table above "
                "with and without `overlap_sync` (its one-window-late updates may cost more steps than "
                "it saves time), each with an outer Nesterov SGD (lr 0.1, momentum 0.9: `_nesterov`) or "
                '`combine="mean"` (`_mean`): the Adasum of 10-step pseudo-gradients applied as they are '
                "overshoots (docs/local_sgd.md). One run each."
            ).format(lr=target["lr"], every=target["eval_every"], n=target["val_samples"]),
            "",
            _table(
                [
                    "variant",
                    "steps to the target",
                    "training s",
                    "ddp's s / this",
                    "last val_loss",
                    "last val_acc",
                ],
                [
                    [
                        r["variant"],
                        r["reached"]["step"] if r["reached"] else "not reached",
                        f"{r['reached']['train_s']:.1f}" if r["reached"] else f"> {r['train_s']:.1f}",
                        f"{r['ddp_train_s_over_this']:.2f}" if r["ddp_train_s_over_this"] else "",
                        f"{r['history'][-1]['val_loss']:.3f}" if r["history"] else "",
                        f"{r['history'][-1]['val_acc']:.3f}" if r["history"] else "",
                    ]
                    for r in target["runs"]
                ],
            ),
            "",
        ]
        best = next((r for r in target["runs"] if r["variant"] == target.get("best")), None)
        if best:
            ratio = best["ddp_train_s_over_this"]
            met = "met" if ratio >= target["aim"] else "not met"
            md += [
                f"The best `ddp_adasum` run, `{best['variant']}`, reached the target {ratio:.2f} × sooner "
                f"than Lightning `ddp` (aim ≥ {target['aim']:g}: {met}).",
                "",
            ]
    md += [f"The part took {result['seconds'] / 60:.1f} min.", ""]
    return md


def _kwargs_label(runs: list[dict], variant: str) -> str:
    run = next(r for r in runs if r["variant"] == variant)
    kwargs = ", ".join(f"{k}={v!r}" for k, v in run["strategy_kwargs"].items())
    return f"`{run['strategy']}`" + (f" `{kwargs}`" if kwargs else "")


def _slow_link_plot(blocks: list[dict], path: Path) -> None:
    """Bars of median steps/s per variant, one per rig and rate, with the rounds' range."""
    variants = list(dict.fromkeys(v for b in blocks for v in b["summary"]["variants"]))
    fig, ax = plt.subplots(figsize=(max(7, 0.8 * len(variants) + 2), 4.2))
    width = 0.8 / len(blocks)
    for k, block in enumerate(blocks):
        rows = block["summary"]["variants"]
        xs = [i + (k - (len(blocks) - 1) / 2) * width for i, v in enumerate(variants) if v in rows]
        stats = [rows[v]["steps_per_s"] for v in variants if v in rows]
        med = [st["median"] for st in stats]
        err = [[m - st["min"] for m, st in zip(med, stats, strict=True)],
               [st["max"] - m for m, st in zip(med, stats, strict=True)]]  # fmt: skip
        ax.bar(xs, med, width, yerr=err, capsize=3, label=f"{block['rig']}, {block['rate']}")
    ax.set_xticks(range(len(variants)), variants, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("steps/s (median; bar: range of the rounds)")
    ax.set_title("MLP 57 MB, N = 2, on a rate-limited link")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _allreduce_plot(ared: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for job, color in zip(ared["jobs"], ("tab:blue", "tab:purple", "tab:gray"), strict=False):
        sizes = [r["size_bytes"] for r in job["results"]]
        ax.plot(
            sizes,
            [r["adasum_over_average"] for r in job["results"]],
            marker="o",
            color=color,
            label=f"Adasum / Average, {job['world_size']} processes",
        )
        ax.plot(
            sizes,
            [r["adasum_over_sum"] for r in job["results"]],
            marker=".",
            linestyle="--",
            color=color,
            label=f"Adasum / Sum, {job['world_size']} processes",
        )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tensor size (bytes)")
    ax.set_ylabel("time ratio (median)")
    ax.set_title("Allreduce time ratio per tensor size")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    import sys

    write_report(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "benchmarks" / "results")
