"""Steps/s and time to a target loss on a rate-limited link (part ``slow_link``).

Two rigs, both sending only inside network namespaces made for one job (names unique to it; every process
left in them is killed and they are deleted on the way out, also on errors):

- ``loopback`` (the headline): both ranks in one namespace whose ``lo`` is limited by a token bucket
  (``tc qdisc add dev lo root tbf rate RATE burst 1mb latency 500ms``; both directions share the bucket),
  started with ``ip netns exec NS python -m benchmarks.slow_link … --devices 2`` (Lightning's launcher
  starts the second rank inside it);
- ``two_hosts``: the emulated hosts of ``tests/twohosts.py`` with a bucket on each end of their link (one per
  direction), one rank per host (``num_nodes=2``, ``NODE_RANK``, Gloo on ``hvd0``).

The variants (:data:`VARIANTS`) are strategy keyword arguments. ``post_local_sgd_10`` is
Lightning's post-local SGD with its DDP communication hook registered by hand (:class:`PostLocalSGDStrategy`:
Lightning registers hooks on CUDA only). ``torchft_diloco_H`` is torchft's ``DiLoCo`` with real Managers and
lighthouse (``benchmarks/slow_link_torchft.py``: a raw torch loop in torchft's scratch environment, run as
a second job of the round in the same rig; torchft has no Lightning strategy); where that environment is
absent (:func:`torchft_python`) it is reported as skipped. Model: the MLP 784 → 4 × 2048 → 10 of
``benchmarks/loops.py`` (14.2 M parameters, 57 MB float32), SGD momentum 0.9, batch 64 per rank, MNIST, one
thread per process.

Worker usage (one job, a fit per variant in the processes Lightning starts once; rank 0 writes
``OUT/<variant>.json``; the part itself: ``python -m benchmarks --only slow_link``):
    python -m benchmarks.slow_link OUT --variants NAME:SKIP:STEPS,... [--devices 2 | --num-nodes 2]
    python -m benchmarks.slow_link OUT --variants NAME --steps MAX --target-loss L --eval-every E
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset
from tqdm.auto import tqdm
from typing_extensions import override

from benchmarks.common import lightning_launch, logs_for, tensor_split
from benchmarks.loops import BATCH, MOMENTUM, ReductionTimer, StepClock, make_model, synthetic_data

#: name → (strategy: ``ddp``, ``post_local_sgd``, ``torchft_diloco`` or ``ddp_adasum``, its keyword
#: arguments).
VARIANTS: dict[str, tuple[str, dict]] = {
    "ddp": ("ddp", {}),
    "post_local_sgd_10": ("post_local_sgd", {"model_averaging_period": 10}),
    **{f"torchft_diloco_{h}": ("torchft_diloco", {"sync_every": h}) for h in (10, 50)},
    "adasum": ("ddp_adasum", {}),
    "adasum_bf16": ("ddp_adasum", {"compression": "bf16"}),
    # buckets of about one layer: the first exchange starts early in backward
    "adasum_bf16_overlap_backward": (
        "ddp_adasum",
        {"compression": "bf16", "overlap_backward": True, "bucket_cap_mb": 4},
    ),
    **{
        f"adasum_s{h}{'_overlap' * o}{'_bf16' * c}": (
            "ddp_adasum",
            {
                "sync_every": h,
                **({"overlap_sync": True} if o else {}),
                **({"compression": "bf16"} if c else {}),
            },
        )
        for h in (10, 50)
        for o in (False, True)
        for c in (False, True)
    },
    "ceiling": ("ddp_adasum", {"sync_every": 1000}),
}
#: The variants of a block whose ``variants`` is ``"all"``: those of the steps/s comparison.
THROUGHPUT = tuple(VARIANTS)
#: How the pseudo-gradients of a window are applied, for the time to the target loss (without either, the
#: Adasum of 10-step pseudo-gradients overshoots: docs/local_sgd.md).
COMBINATIONS = {
    "mean": {"combine": "mean"},
    "nesterov": {"outer_optimizer": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, nesterov=True)},
}
VARIANTS.update(
    {
        f"{name}_{c}": ("ddp_adasum", {**VARIANTS[name][1], **kwargs})
        for name in THROUGHPUT
        if name.startswith("adasum_s10")
        for c, kwargs in COMBINATIONS.items()
    }
)
#: The ratios reported per round, (numerator, denominator, target or None); ``best_s10``: the fastest
#: ``sync_every=10`` variant of that rig and rate (by median steps/s).
RATIOS = (
    ("adasum_s10_overlap_bf16", "ceiling", 0.90),
    ("adasum_bf16_overlap_backward", "ddp", 1.8),
    ("adasum_bf16", "ddp", None),
    ("best_s10", "post_local_sgd_10", 1.5),
    ("adasum_s10", "ceiling", None),
    ("adasum", "ddp", None),
    ("adasum_s10", "post_local_sgd_10", None),
)
#: The aim for ``ddp``'s training time to the target loss over the best ``ddp_adasum`` run's.
SOONER_THAN_DDP = 3.0
#: Post-local SGD: DDP's allreduce on the first step only, then local steps; Lightning's model averager then
#: averages after optimizer steps 2, 12, 22, … at period 10.
POST_LOCAL_START = 1


def period(variant: str) -> int:
    """Steps between exchanges (1: every step)."""
    kwargs = VARIANTS[variant][1]
    return kwargs.get("sync_every") or kwargs.get("model_averaging_period") or 1


def torchft_python() -> str:
    """The python of torchft's scratch environment: ``ADASUM_TORCHFT_PYTHON``, else
    ``/tmp/tft/bin/python``."""
    return os.environ.get("ADASUM_TORCHFT_PYTHON", "/tmp/tft/bin/python")


@functools.cache
def _torchft_missing(python: str) -> str | None:
    if not Path(python).exists():
        return f"no torchft environment at {python} (ADASUM_TORCHFT_PYTHON; docs/local_sgd.md sets one up)"
    proc = subprocess.run([python, "-c", "import torchft"], capture_output=True, text=True, timeout=120)
    return f"{python} cannot import torchft" if proc.returncode else None


def skip_reason(variant: str, rig: str) -> str | None:
    """Why ``variant`` cannot run on ``rig`` here; ``None`` where it can."""
    if VARIANTS[variant][0] == "torchft_diloco":
        return (
            "torchft's DiLoCo runs on the loopback rig only"
            if rig != "loopback"
            else _torchft_missing(torchft_python())
        )
    return None


# ---------------------------------------------------------------------------------------------- the worker
class PostLocalSGDStrategy(DDPStrategy):
    """``DDPStrategy(model_averaging_period=H)`` with ``post_localSGD_hook`` registered on CPU too: after
    step :data:`POST_LOCAL_START` DDP reduces within one rank each (no exchange), and Lightning's averager
    averages the parameters over all ranks every H steps."""

    @override
    def _register_ddp_hooks(self) -> None:
        from pytorch_lightning.overrides.distributed import _register_ddp_comm_hook
        from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_local

        self._ddp_comm_state = post_local.PostLocalSGDState(
            process_group=None,
            subgroup=dist.new_subgroups(group_size=1)[0],
            start_localSGD_iter=POST_LOCAL_START,
        )
        _register_ddp_comm_hook(
            model=self.model, ddp_comm_state=self._ddp_comm_state, ddp_comm_hook=post_local.post_localSGD_hook
        )


def make_strategy(variant: str) -> pl.strategies.Strategy:
    from adasum_lightning.trainer import DDPAdasumStrategy

    kind, kwargs = VARIANTS[variant]
    cls = {"ddp": DDPStrategy, "post_local_sgd": PostLocalSGDStrategy, "ddp_adasum": DDPAdasumStrategy}[kind]
    return cls(**kwargs)


class MLP(pl.LightningModule):
    def __init__(self, data: TensorDataset, lr: float, hidden: int) -> None:
        super().__init__()
        self.model, self.data, self.lr = make_model("mlp", hidden), data, lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.nll_loss(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=MOMENTUM)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=BATCH, shuffle=True)


class Clock(Callback):
    """Drives :class:`benchmarks.loops.StepClock` (rank 0 times steps ``skip`` … end)."""

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.clock.before_step(batch_idx)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.clock.after_step(batch_idx)


class ToTarget(Callback):
    """Every ``every`` steps after the variant's syncs (``offset``): each rank's model on the validation
    tensors, loss and accuracy averaged over the ranks; stops every rank once the loss is ≤ ``target``, or
    once ``max_train_s`` of training passed. Training time: wall time from the first step's start, the
    evaluations left out."""

    def __init__(self, val: tuple[torch.Tensor, torch.Tensor], target: float, every: int, offset: int,
                 max_train_s: float) -> None:  # fmt: skip
        self.val, self.target, self.max_train_s = val, target, max_train_s
        self.every, self.offset = every, offset
        self.history: list[dict] = []
        self.start: float | None = None
        self.eval_s = 0.0

    def train_s(self) -> float:
        return time.perf_counter() - self.start - self.eval_s

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.start is None:
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step <= self.offset or (step - self.offset) % self.every:
            return
        train_s, begin = self.train_s(), time.perf_counter()
        with torch.no_grad():
            x, y = self.val
            out = pl_module.model(x)
            mine = (F.nll_loss(out, y).item(), (out.argmax(1) == y).float().mean().item())
        every_rank = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, mine)
        losses = [r[0] for r in every_rank]
        row = {"step": step, "train_s": train_s, "val_loss": statistics.mean(losses),
               "val_acc": statistics.mean(r[1] for r in every_rank),
               "val_loss_rank_spread": max(losses) - min(losses)}  # fmt: skip
        self.history.append(row)
        trainer.should_stop = row["val_loss"] <= self.target or train_s >= self.max_train_s
        self.eval_s += time.perf_counter() - begin


class Trace(Callback):
    """Every rank's flat parameters after each step, saved to ``folder/rank<r>.pt`` at the end of fit."""

    def __init__(self, folder: str) -> None:
        self.folder, self.params = Path(folder), []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.params.append(torch.cat([p.detach().reshape(-1) for p in pl_module.model.parameters()]).clone())

    def on_fit_end(self, trainer, pl_module):
        self.folder.mkdir(parents=True, exist_ok=True)
        torch.save({"params": self.params}, self.folder / f"rank{trainer.global_rank}.pt")


def fit(variant: str, skip: int, steps: int, args: argparse.Namespace, data: TensorDataset,
        reduction: ReductionTimer) -> dict:  # fmt: skip
    """One fit of ``variant``, ``steps`` steps of which the first ``skip`` untimed; rank 0's result (other
    ranks: ``{}``)."""
    reduction.seconds, reduction.bytes, reduction.on = 0.0, 0, False
    clock = StepClock(skip, reduction)
    callbacks: list[Callback] = [Clock(clock)]
    target = None
    if args.target_loss is not None:
        val = tensor_split(args.data, train=False)[: args.val_samples]
        offset = POST_LOCAL_START + 1 if VARIANTS[variant][0] == "post_local_sgd" else 0
        target = ToTarget(val, args.target_loss, args.eval_every, offset, args.max_train_s)
        callbacks.append(target)
    if args.trace:
        callbacks.append(Trace(os.path.join(args.trace, variant)))
    pl.seed_everything(args.seed, verbose=False)
    trainer = pl.Trainer(
        strategy=make_strategy(variant),
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=callbacks,
    )
    trainer.fit(MLP(data, args.lr, args.hidden))
    peak = [None] * trainer.world_size
    dist.all_gather_object(peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if trainer.global_rank != 0:
        return {}
    seconds = clock.end - clock.start
    result = {
        "variant": variant,
        "strategy": VARIANTS[variant][0],
        "strategy_kwargs": VARIANTS[variant][1],
        "world_size": trainer.world_size,
        "num_nodes": args.num_nodes,
        "global_step": trainer.global_step,
        "skip": skip,
        "timed_steps": clock.steps,
        "seconds": seconds,
        "steps_per_s": clock.steps / seconds if clock.steps else None,
        "reduction_ms_per_step": 1e3 * reduction.seconds / clock.steps if clock.steps else None,
        "peak_rss_mb_per_rank": peak,
        "parameters": sum(p.numel() for p in make_model("mlp", args.hidden).parameters()),
    }
    if target is not None:
        reached = next((h for h in target.history if h["val_loss"] <= args.target_loss), None)
        result.update(history=target.history, reached=reached, train_s=target.train_s(), eval_s=target.eval_s)
    return result


def worker(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="a folder: rank 0 writes <variant>.json per fit")
    p.add_argument(
        "--variants",
        required=True,
        help="comma-separated NAME or NAME:SKIP:STEPS, fitted in this order in one job",
    )
    p.add_argument("--devices", type=int, default=2, help="processes per node (Lightning starts them)")
    p.add_argument("--num-nodes", type=int, default=1, help="nodes (NODE_RANK, MASTER_ADDR set outside)")
    p.add_argument("--steps", type=int, default=0, help="steps, warm-up included (to a target: at most)")
    p.add_argument("--skip", type=int, default=0, help="untimed warm-up steps")
    p.add_argument("--data", default="synthetic", help="an MNIST torchvision root, or 'synthetic'")
    p.add_argument("--hidden", type=int, default=2048, help="the MLP's hidden width")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target-loss", type=float, default=None, help="stop once the validation loss is ≤ this")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--val-samples", type=int, default=1000, help="the first of MNIST's test split")
    p.add_argument("--max-train-s", type=float, default=float("inf"), help="to a target: training time cap")
    p.add_argument("--trace", default=None, help="a folder: every rank's parameters after each step")
    args = p.parse_args(argv)
    jobs = [(*item.split(":"), args.skip, args.steps)[:3] for item in args.variants.split(",")]
    unknown = {name for name, _, _ in jobs} - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    world = args.devices * args.num_nodes
    most = max(int(steps) for _, _, steps in jobs)
    data = synthetic_data(most, world) if args.data == "synthetic" else tensor_split(args.data, train=True)
    reduction = ReductionTimer()
    for variant, skip, steps in jobs:
        result = fit(variant, int(skip), int(steps), args, data, reduction)
        if result:
            out = Path(args.out) / f"{variant}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({**result, "config": vars(args)}, indent=1, default=repr) + "\n")


# ---------------------------------------------------------------------------------------------- the rigs
def _kill_and_delete(netns: str, timeout: float = 10.0) -> None:
    """SIGKILL every process in ``netns`` until none is left, then delete it.

    Raises:
        RuntimeError: a process survived, or the namespace could not be deleted.
    """
    from tests.twohosts import netns_pids

    deadline = time.monotonic() + timeout
    while (pids := netns_pids(netns)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    proc = subprocess.run(["ip", "netns", "del", netns], capture_output=True, text=True, timeout=30)
    if pids or proc.returncode != 0:
        raise RuntimeError(f"tearing down {netns}: left {pids}, ip netns del: {proc.stderr.strip()}")


def limit(netns: str, dev: str, rate: str) -> None:
    """A token bucket of ``rate`` on ``dev``'s egress in ``netns``."""
    from tests.twohosts import _check

    _check("ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
           "burst", "1mb", "latency", "500ms")  # fmt: skip


@contextlib.contextmanager
def limited_loopback(rate: str) -> Iterator[str]:
    """A network namespace (its name, unique to this job) whose ``lo`` passes ``rate``; torn down on exit."""
    from tests.twohosts import _check

    netns = f"asl{os.getpid()}{random.randrange(16**4):04x}"
    try:
        _check("ip", "netns", "add", netns)
        _check("ip", "netns", "exec", netns, "ip", "link", "set", "lo", "up")
        limit(netns, "lo", rate)
        yield netns
    finally:
        if Path("/run/netns", netns).exists():
            _kill_and_delete(netns)


def run_loopback(rate: str, args: list[str], log: Path, timeout: float, python: str = sys.executable
                 ) -> tuple[float, str]:  # fmt: skip
    """One job (``python -m ARGS``) on the ``loopback`` rig: (wall seconds, its command)."""
    args = [*args, "--devices", "2"]
    with limited_loopback(rate) as netns:
        prefix = ["ip", "netns", "exec", netns]
        wall = lightning_launch(args, log=log, timeout=timeout, retries=0, prefix=prefix, python=python)
    return wall, f"ip netns exec NS {'python' if python == sys.executable else python} -m {' '.join(args)}"


def run_two_hosts(rate: str, args: list[str], log: Path, timeout: float, python: str = sys.executable
                  ) -> tuple[float, str]:  # fmt: skip
    """One job (``python -m ARGS``) on the ``two_hosts`` rig, one rank per host: (wall seconds, its
    command)."""
    from tests.twohosts import ADDRESSES, IFACE, two_hosts

    argv = [python, "-m", *args, "--devices", "1", "--num-nodes", "2"]
    with two_hosts() as hosts:
        for netns in hosts.netns.values():
            limit(netns, IFACE, rate)
        env = dict(MASTER_ADDR=ADDRESSES["hostA"], MASTER_PORT="29500", GLOO_SOCKET_IFNAME=IFACE,
                   PYTHONWARNINGS="ignore")  # fmt: skip
        start = time.perf_counter()
        procs = [
            hosts.popen(
                host,
                *argv,
                env=hosts.env(**env, NODE_RANK=str(r)),
                timeout=timeout,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
            for r, host in enumerate(("hostA", "hostB"))
        ]
        outputs = [proc.communicate(timeout=timeout + 15)[0] for proc in procs]
        wall = time.perf_counter() - start
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("\n".join(f"### NODE_RANK={r}: exit {p.returncode}\n{o}" for r, (p, o) in
                             enumerate(zip(procs, outputs, strict=True))))  # fmt: skip
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{' '.join(argv)} failed on the two hosts:\n{outputs[0][-3000:]}")
    return wall, f"on each host (NODE_RANK=0|1, MASTER_ADDR=hostA): {' '.join(['python', *argv[1:]])}"


RIGS = {"loopback": run_loopback, "two_hosts": run_two_hosts}


# ---------------------------------------------------------------------------------------------- the part
def _spread(values: list[float]) -> dict:
    return {"values": values, "median": statistics.median(values), "min": min(values), "max": max(values)}


def throughput(block: dict, cfg: dict, out_dir: Path, data: str) -> dict:
    """One rig and rate: per round a job (its own namespaces) fitting every Lightning variant once, one
    after the other in the same processes, and one for torchft's variants (``slow_link_torchft``, by
    torchft's python); the order of the jobs and within each rotated each round."""
    variants = list(THROUGHPUT) if block["variants"] == "all" else list(block["variants"])
    skipped = {v: why for v in variants if (why := skip_reason(v, block["rig"]))}
    ran = [v for v in variants if v not in skipped]
    torchft = [v for v in ran if VARIANTS[v][0] == "torchft_diloco"]
    # (module suffix, python, extra arguments, variants) per job.
    jobs = [
        job
        for job in (
            ("", sys.executable, [], [v for v in ran if v not in torchft]),
            ("_torchft", torchft_python(), ["--site", sysconfig.get_paths()["purelib"]], torchft),
        )
        if job[3]
    ]
    steps = {**cfg["steps"], **block.get("steps", {})}
    tag = f"{block['rig']}_{block['rate']}"
    runs = []
    for i in tqdm(range(block["rounds"]), desc=f"slow_link {tag}", unit="round"):
        for suffix, python, extra, group in jobs[i % len(jobs) :] + jobs[: i % len(jobs)]:
            order = group[i % len(group) :] + group[: i % len(group)]
            items = [f"{v}:{steps[str(period(v))][0]}:{sum(steps[str(period(v))])}" for v in order]
            out = out_dir / "runs" / f"slow_link_{tag}_r{i}{suffix}"
            args = [f"benchmarks.slow_link{suffix}", str(out), "--variants", ",".join(items), "--data", data]
            load = os.getloadavg()
            log = logs_for(out_dir) / f"slow_link_{tag}_r{i}{suffix}.log"
            wall, command = RIGS[block["rig"]](block["rate"], args + extra, log, cfg["timeout_s"], python)
            record = {"round": i, "job_wall_s": wall, "loadavg_before": load, "command": command}
            runs += [{**json.loads((out / f"{v}.json").read_text()), **record} for v in order]
    return {**block, "skipped": skipped, "runs": runs, "summary": summarise(runs, ran)}


def summarise(runs: list[dict], variants: list[str]) -> dict:
    """Per variant: steps/s and the fraction of the same round's ceiling (median, min, max); the
    :data:`RATIOS` within each round."""
    by = {(r["variant"], r["round"]): r["steps_per_s"] for r in runs}
    rounds = sorted({r["round"] for r in runs})
    summary: dict = {"variants": {}, "ratios": {}}
    for v in variants:
        row = {"steps_per_s": _spread([by[v, i] for i in rounds])}
        if "ceiling" in variants:
            row["fraction_of_ceiling"] = _spread([by[v, i] / by["ceiling", i] for i in rounds])
        summary["variants"][v] = row
    s10 = [v for v in variants if v.startswith("adasum_s10")]
    best = max(s10, key=lambda v: summary["variants"][v]["steps_per_s"]["median"]) if s10 else None
    for num, den, target in RATIOS:
        name = best if num == "best_s10" else num
        if name in variants and den in variants:
            ratio = _spread([by[name, i] / by[den, i] for i in rounds])
            summary["ratios"][f"{num}/{den}"] = {**ratio, "numerator": name, "target": target}
    return summary


def to_target(cfg: dict, out_dir: Path, data: str, speed: dict[str, float]) -> dict:
    """Training time to the target validation loss on the loopback rig: Lightning ``ddp`` first, then
    post-local SGD and the fastest ``sync_every=10`` setting of ``ddp_adasum`` with and the fastest without
    ``overlap_sync`` (``speed``: steps/s by variant; overlap's late updates may cost more steps than it
    saves time), each with each of :data:`COMBINATIONS`; each capped at ``ddp``'s time (not reached by
    then: not faster). ``best``: the ``ddp_adasum`` run that reached the target soonest."""
    tcfg = cfg["target"]
    s10 = [v for v in speed if v.startswith("adasum_s10") and v in THROUGHPUT]
    fastest: dict[bool, str] = {}  # by overlap_sync
    for v in sorted(s10, key=speed.get, reverse=True):
        fastest.setdefault(VARIANTS[v][1].get("overlap_sync", False), v)
    combinations = tcfg["combinations"]
    variants = ["ddp", "post_local_sgd_10", *(f"{w}_{c}" for w in fastest.values() for c in combinations)]
    runs, cap = [], tcfg["max_train_s"]
    for variant in tqdm(variants, desc="slow_link to target", unit="run"):
        out = out_dir / "runs" / "slow_link_target"
        args = ["benchmarks.slow_link", str(out), "--variants", variant, "--data", data,
                "--steps", str(tcfg["max_steps"]), "--target-loss", str(tcfg["target_loss"]),
                "--eval-every", str(tcfg["eval_every"]), "--val-samples", str(tcfg["val_samples"]),
                "--lr", str(tcfg["lr"]), "--max-train-s", f"{cap:.1f}"]  # fmt: skip
        log = logs_for(out_dir) / f"slow_link_target_{variant}.log"
        wall, command = run_loopback(tcfg["rate"], args, log, cfg["timeout_s"] + cap)
        run = {**json.loads((out / f"{variant}.json").read_text()), "job_wall_s": wall, "command": command}
        runs.append(run)
        if variant == "ddp" and run["reached"]:
            cap = run["reached"]["train_s"]
    ddp = runs[0]["reached"]
    for run in runs:
        mine = run["reached"]
        run["ddp_train_s_over_this"] = ddp["train_s"] / mine["train_s"] if ddp and mine else None
    adasum = [r for r in runs if r["strategy"] == "ddp_adasum" and r["ddp_train_s_over_this"]]
    best = max(adasum, key=lambda r: r["ddp_train_s_over_this"])["variant"] if adasum else None
    return {**tcfg, "runs": runs, "best": best, "aim": SOONER_THAN_DDP}


def run(cfg: dict, out_dir: Path, data: str) -> dict:
    """The part: every block of ``cfg["blocks"]`` (rig, rate, variants, rounds), then the time to target."""
    from tests.twohosts import unavailable_reason

    reason = unavailable_reason() or (None if shutil.which("tc") else "the rate limits need tc (iproute2)")
    if reason:
        return {"config": cfg, "unavailable": reason}
    start = time.perf_counter()
    blocks = [throughput(block, cfg, out_dir, data) for block in cfg["blocks"]]
    speed = {v: row["steps_per_s"]["median"] for v, row in blocks[0]["summary"]["variants"].items()}
    target = to_target(cfg, out_dir, data, speed) if cfg.get("target") else None
    seconds = time.perf_counter() - start
    tqdm.write(f"[slow_link] took {seconds / 60:.1f} min")
    return {"config": cfg, "blocks": blocks, "target": target, "seconds": seconds}


if __name__ == "__main__":
    worker()
