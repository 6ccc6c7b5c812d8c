"""Allreduce time of ``adasum_allreduce`` (Gloo) vs Horovod's MPI Adasum vs Gloo's own sum (float32, CPU).

Run under ``horovodrun -np N``: next to Horovod, every rank joins a Gloo process group (rank 0 picks a
free port, Horovod broadcasts it). For each size the three ops run in interleaved rounds (so that a noisy
neighbour hits them alike), each on a fresh copy of the same per-rank input (the copy is not timed) and
after a barrier; rank 0 writes the median seconds per op and size to a JSON file. Optionally a breakdown
of ``adasum_allreduce``'s time at one size: large exchanges, the small dot-product exchanges, the float64
dot products, the float64 combination, and the rest (packing, planning, Python).

Ops: ``ours`` = :func:`adasum_lightning.allreduce.adasum_allreduce` over Gloo; ``horovod_adasum`` =
``hvd.allreduce_(op=hvd.Adasum)`` over MPI (in place, like ours); ``gloo_sum`` =
``torch.distributed.all_reduce`` (SUM) over the same Gloo group, the transport reference.

usage: python -m benchmarks.adasum_allreduce OUT.json [--sizes-kb 4,16,...] [--breakdown-kb 65536]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import horovod.torch as hvd
import torch
import torch.distributed as dist
from lightning_fabric.plugins.environments.lightning import find_free_network_port

import adasum_lightning.allreduce as ar

OPS = ("ours", "horovod_adasum", "gloo_sum")


def init_gloo_beside_horovod() -> None:
    """A Gloo process group of Horovod's ranks (FIELD_NOTES §9: works next to Horovod's MPI)."""
    port = find_free_network_port() if hvd.rank() == 0 else 0
    port = hvd.broadcast_object(port, root_rank=0, name="gloo_port")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=hvd.rank(), world_size=hvd.size()
    )


def run_op(name: str, tensor: torch.Tensor, tag: str) -> None:
    if name == "ours":
        ar.adasum_allreduce([tensor])
    elif name == "horovod_adasum":
        hvd.allreduce_(tensor, op=hvd.Adasum, name=tag)
    else:
        dist.all_reduce(tensor)


def breakdown(source: torch.Tensor, rounds: int) -> dict:
    """Median seconds per part of ``adasum_allreduce`` over ``rounds`` instrumented calls.

    ``exchange``: sending and receiving the large messages (waiting included); ``small_exchange``: the
    sums of the per-tensor dot products over ranks (``group_sum``: its messages, and waiting for the
    partner to finish its dot products); ``dots_float64`` / ``combine_float64``: the float64 dot products
    and combination (conversions included); ``other``: the rest (packing, planning, Python).
    """
    parts = ("exchange", "small_exchange", "dots_float64", "combine_float64")
    acc = dict.fromkeys(parts, 0.0)
    state = {"in_small": False}

    def timed(fn: Callable, key: str) -> Callable:
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if not (key == "exchange" and state["in_small"]):
                    acc[key] += time.perf_counter() - start

        return wrapper

    def small(fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            state["in_small"] = True
            try:
                return timed(fn, "small_exchange")(*args, **kwargs)
            finally:
                state["in_small"] = False

        return wrapper

    orig = (ar.Communicator.exchange, ar.Communicator.group_sum, ar.local_grams, ar.scaled_add)
    ar.Communicator.exchange = timed(orig[0], "exchange")
    ar.Communicator.group_sum = small(orig[1])
    ar.local_grams = timed(orig[2], "dots_float64")
    ar.scaled_add = timed(orig[3], "combine_float64")
    samples = []
    try:
        tensor = source.clone()
        for _ in range(rounds):
            tensor.copy_(source)
            acc.update(dict.fromkeys(parts, 0.0))
            dist.barrier()
            start = time.perf_counter()
            ar.adasum_allreduce([tensor])
            total = time.perf_counter() - start
            samples.append({"total": total, **acc, "other": total - sum(acc.values())})
    finally:
        ar.Communicator.exchange, ar.Communicator.group_sum, ar.local_grams, ar.scaled_add = orig
    return {k: statistics.median(s[k] for s in samples) for k in (*parts, "other", "total")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--sizes-kb", default=",".join(str(4 * 2**i) for i in range(15)), help="4 KB … 64 MB")
    p.add_argument("--budget-s", type=float, default=0.5, help="time per size and op (sets the rounds)")
    p.add_argument("--min-rounds", type=int, default=5)
    p.add_argument("--max-rounds", type=int, default=50)
    p.add_argument("--breakdown-kb", type=int, default=0, help="also break our time down at this size")
    p.add_argument("--breakdown-rounds", type=int, default=10)
    args = p.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    init_gloo_beside_horovod()
    gen = torch.Generator().manual_seed(1234 + hvd.rank())
    results = []
    for kb in (int(s) for s in args.sizes_kb.split(",")):
        source = torch.randn(kb * 1024 // 4, generator=gen)
        tensor = source.clone()
        times: dict[str, list[float]] = {name: [] for name in OPS}
        for name in OPS:  # warm-up (Horovod negotiates a new name; our receive buffer grows)
            tensor.copy_(source)
            dist.barrier()
            start = time.perf_counter()
            run_op(name, tensor, f"adasum.{kb}")
            times[name].append(time.perf_counter() - start)
        slowest = max(t[0] for t in times.values())
        rounds = hvd.broadcast_object(
            int(min(args.max_rounds, max(args.min_rounds, args.budget_s / max(slowest, 1e-6)))), root_rank=0
        )
        times = {name: [] for name in OPS}
        for _ in range(rounds):
            for name in OPS:
                tensor.copy_(source)
                dist.barrier()
                start = time.perf_counter()
                run_op(name, tensor, f"adasum.{kb}")
                times[name].append(time.perf_counter() - start)
        med = {name: statistics.median(t) for name, t in times.items()}
        row = {
            "size_bytes": source.numel() * 4,
            "rounds": rounds,
            "median_s": med,
            "min_s": {name: min(t) for name, t in times.items()},
        }
        if "ours" in med:
            row["ours_over_horovod"] = med["ours"] / med["horovod_adasum"]
            row["ours_over_gloo_sum"] = med["ours"] / med["gloo_sum"]
        results.append(row)
        if hvd.rank() == 0:
            print(
                f"{kb} KB ({rounds} rounds): " + ", ".join(f"{k} {1e3 * v:.3f} ms" for k, v in med.items()),
                flush=True,
            )
    payload = {"world_size": hvd.size(), "dtype": "float32", "ops": list(OPS), "results": results}
    if args.breakdown_kb:
        source = torch.randn(args.breakdown_kb * 1024 // 4, generator=gen)
        payload["breakdown"] = {
            "size_bytes": source.numel() * 4,
            "rounds": args.breakdown_rounds,
            "median_s": breakdown(source, args.breakdown_rounds),
        }
        if hvd.rank() == 0:
            print(
                "breakdown (ms):", {k: round(1e3 * v, 2) for k, v in payload["breakdown"]["median_s"].items()}
            )
    if hvd.rank() == 0:
        Path(args.out).write_text(json.dumps(payload, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
