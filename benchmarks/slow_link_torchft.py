"""torchft's ``DiLoCo`` on the slow link: the ``torchft_diloco_H`` variants of ``benchmarks/slow_link.py``.

torchft has no Lightning strategy, so this is a raw torch loop, run by the python of a scratch environment
that holds torchft (``python3 -m venv /tmp/tft && /tmp/tft/bin/pip install torchft numpy``; another path:
``ADASUM_TORCHFT_PYTHON``). This checkout's helpers come from the project environment's site-packages
(``--site``), appended to ``sys.path`` after torchft's own torch.

The first process runs torchft's lighthouse (:class:`torchft.coordination.LighthouseServer`) and starts one
process per replica group of size 1 for each variant. Each has its own ``TCPStore``, a
:class:`torchft.manager.Manager` (synchronous quorum) with :class:`torchft.process_group.ProcessGroupGloo`,
and the model, data, batch and inner SGD of the Lightning variants, wrapped in
:class:`torchft.local_sgd.DiLoCo` (one fragment, ``sync_every=H``) with the outer Nesterov SGD of
``slow_link.COMBINATIONS["nesterov"]``. Replica 0 times the steps as the Lightning fits do, and the first
process writes ``OUT/<variant>.json`` with the same fields.

usage: TORCHFT_PYTHON -m benchmarks.slow_link_torchft OUT --variants NAME:SKIP:STEPS,... --site DIR
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import types
from datetime import timedelta
from itertools import islice
from pathlib import Path

import torch
import torch.nn.functional as F

#: Timeout of the Manager's and the process group's operations.
TIMEOUT = timedelta(seconds=120)


def replica(variant: str, skip: int, steps: int, args: argparse.Namespace) -> dict:
    """``steps`` steps of replica group ``args.replica`` (its flat parameters after each step in
    ``args.trace/variant/rank<r>.pt`` with ``--trace``); its result."""
    from torch.distributed import TCPStore
    from torch.utils.data import DataLoader, DistributedSampler
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    from benchmarks.common import tensor_split
    from benchmarks.loops import BATCH, MOMENTUM, StepClock, make_model, synthetic_data
    from benchmarks.slow_link import COMBINATIONS, VARIANTS

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    world, rank = args.devices, args.replica
    data = synthetic_data(steps, world) if args.data == "synthetic" else tensor_split(args.data, train=True)
    torch.manual_seed(args.seed)
    model = make_model("mlp", args.hidden)
    inner = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=MOMENTUM)
    outer = COMBINATIONS["nesterov"]["outer_optimizer"](model.parameters())
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    # Every replica starts from the same seed: no weights sent at the first quorum (init_sync=False).
    manager = Manager(pg=ProcessGroupGloo(timeout=TIMEOUT), load_state_dict=None, state_dict=None,
                      min_replica_size=world, use_async_quorum=False, replica_id=f"replica{rank}",
                      store_addr="localhost", store_port=store.port, rank=0, world_size=1,
                      lighthouse_addr=args.lighthouse, hostname="localhost", init_sync=False,
                      timeout=TIMEOUT, quorum_timeout=TIMEOUT)  # fmt: skip
    sampler = DistributedSampler(data, world, rank, shuffle=True, seed=args.seed)
    clock = StepClock(skip, types.SimpleNamespace(on=False))
    trace = []
    with DiLoCo(
        manager, [model], inner, outer, sync_every=VARIANTS[variant][1]["sync_every"], pin_memory=False
    ):
        for i, (x, y) in enumerate(islice(DataLoader(data, batch_size=BATCH, sampler=sampler), steps)):
            clock.before_step(i)
            inner.zero_grad()
            F.nll_loss(model(x), y).backward()
            inner.step()
            clock.after_step(i)
            if args.trace:
                trace.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone())
    manager.shutdown()
    if args.trace:
        folder = Path(args.trace, variant)
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({"params": trace}, folder / f"rank{rank}.pt")
    seconds = clock.end - clock.start
    return {
        "variant": variant,
        "strategy": VARIANTS[variant][0],
        "strategy_kwargs": VARIANTS[variant][1],
        "world_size": world,
        "num_nodes": 1,
        "global_step": i + 1,
        "skip": skip,
        "timed_steps": clock.steps,
        "seconds": seconds,
        "steps_per_s": clock.steps / seconds if clock.steps else None,
        "reduction_ms_per_step": None,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "parameters": sum(p.numel() for p in model.parameters()),
        "torch": torch.__version__,
        "manager_step": manager.current_step(),
    }


def launch(item: str, argv: list[str], args: argparse.Namespace) -> None:
    """The lighthouse and ``args.devices`` replica processes for one variant; replica 0's result with
    every replica's peak RSS in ``OUT/<variant>.json``.

    Raises:
        RuntimeError: a replica failed.
    """
    from importlib.metadata import version

    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=args.devices)
    address = "http://localhost:" + lighthouse.address().rsplit(":", 1)[1]
    try:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.slow_link_torchft",
                    *argv,
                    "--variants",
                    item,
                    "--replica",
                    str(r),
                    "--lighthouse",
                    address,
                ]
            )  # fmt: skip
            for r in range(args.devices)
        ]
        codes = [p.wait() for p in procs]
    finally:
        lighthouse.shutdown()
    if any(codes):
        raise RuntimeError(f"{item}: replicas exited {codes}")
    variant, out = item.split(":")[0], Path(args.out)
    parts = [out / f"{variant}.rank{r}.json" for r in range(args.devices)]
    ranks = [json.loads(p.read_text()) for p in parts]
    peak = [r.pop("peak_rss_mb") for r in ranks]
    result = {**ranks[0], "peak_rss_mb_per_rank": peak, "torchft": version("torchft")}
    (out / f"{variant}.json").write_text(json.dumps({**result, "config": vars(args)}, indent=1) + "\n")
    for p in parts:
        p.unlink()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="a folder: <variant>.json per variant")
    p.add_argument("--variants", required=True, help="comma-separated NAME:SKIP:STEPS, run in this order")
    p.add_argument("--site", default=None, help="the project environment's site-packages (appended)")
    p.add_argument("--devices", type=int, default=2, help="replica groups (one process each)")
    p.add_argument("--data", default="synthetic", help="an MNIST torchvision root, or 'synthetic'")
    p.add_argument("--hidden", type=int, default=2048, help="the MLP's hidden width")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", default=None, help="a folder: every replica's parameters after each step")
    p.add_argument("--replica", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--lighthouse", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.site:
        sys.path.append(args.site)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    for item in args.variants.split(","):
        if args.replica is None:
            launch(item, argv, args)
            continue
        variant, skip, steps = item.split(":")
        result = replica(variant, int(skip), int(steps), args)
        Path(args.out, f"{variant}.rank{args.replica}.json").write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
