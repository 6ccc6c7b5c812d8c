"""Allreduce time of Horovod's Adasum vs Average vs Sum per tensor size (float32, CPU, MPI).

Run under ``horovodrun -np N``. For each size the three ops are timed in interleaved rounds (so that a
noisy neighbour hits them alike) with synchronous ``hvd.allreduce``; rank 0 writes the median seconds per
op and size to a JSON file.

usage: python -m benchmarks.allreduce OUT.json [--sizes-kb 4,16,...] [--budget-s 0.5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import horovod.torch as hvd
import torch

OPS = {"Adasum": "Adasum", "Average": "Average", "Sum": "Sum"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--sizes-kb", default=",".join(str(4 * 2**i) for i in range(15)), help="4 KB … 64 MB")
    p.add_argument("--budget-s", type=float, default=0.5, help="time per size and op (sets the rounds)")
    p.add_argument("--min-rounds", type=int, default=5)
    p.add_argument("--max-rounds", type=int, default=50)
    args = p.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(hvd.rank())
    results = []
    for kb in (int(s) for s in args.sizes_kb.split(",")):
        tensor = torch.randn(kb * 1024 // 4)
        ops = {name: getattr(hvd, attr) for name, attr in OPS.items()}
        times: dict[str, list[float]] = {name: [] for name in ops}
        # warm-up (one round) also sizes the number of rounds; rank 0 decides for everybody
        for name, op in ops.items():
            start = time.perf_counter()
            hvd.allreduce(tensor, op=op, name=f"{name}.{kb}")
            times[name].append(time.perf_counter() - start)
        slowest = max(t[0] for t in times.values())
        rounds = hvd.broadcast_object(
            int(min(args.max_rounds, max(args.min_rounds, args.budget_s / max(slowest, 1e-6)))), root_rank=0
        )
        times = {name: [] for name in ops}
        for _ in range(rounds):
            for name, op in ops.items():
                hvd.barrier()
                start = time.perf_counter()
                hvd.allreduce(tensor, op=op, name=f"{name}.{kb}")
                times[name].append(time.perf_counter() - start)
        med = {name: statistics.median(t) for name, t in times.items()}
        results.append(
            {
                "size_bytes": tensor.numel() * 4,
                "rounds": rounds,
                "median_s": med,
                "min_s": {name: min(t) for name, t in times.items()},
                "adasum_over_average": med["Adasum"] / med["Average"],
                "adasum_over_sum": med["Adasum"] / med["Sum"],
            }
        )
    if hvd.rank() == 0:
        Path(args.out).write_text(
            json.dumps({"world_size": hvd.size(), "dtype": "float32", "results": results}, indent=1) + "\n"
        )


if __name__ == "__main__":
    main()
