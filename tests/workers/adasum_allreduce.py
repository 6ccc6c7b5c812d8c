"""Worker: ``adasum_allreduce`` on real processes; every rank saves its inputs and results.

usage:
  torchrun --standalone --nproc-per-node N -m tests.workers.adasum_allreduce OUT_DIR gloo [K ...]
      a Gloo process group of N ranks: one call over the default group with every case (four dtypes, so
      four buckets), one call with a single contiguous tensor, one over the sub-group of ranks 1 … N-1
      (rank 0 is no member and calls too), and for each K one with every case over ranks 0 … K-1; the
      calls with every case and the single tensor run through both paths (binomial tree and halving), and
      the single tensor once more through ``adasum_allreduce_flat``, recording what ``on_final`` reports;
      then each 16-bit wire dtype: the float32 cases and the single tensor in one flat buffer through
      ``adasum_allreduce_flat`` (both paths) and ``mean_allreduce_flat``, the cases through
      ``adasum_allreduce`` (the default path), and the single tensor's ``on_final`` ranges.
  horovodrun -np N python -m tests.workers.adasum_allreduce OUT_DIR horovod
      Horovod plus a Gloo group of the same ranks: Horovod's own Adasum allreduce per tensor, then
      ``adasum_allreduce`` of the same inputs in one call.

Every rank writes ``OUT_DIR/rank{r}.pt``; the tests compute the expected values from all ranks' inputs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

import adasum_lightning.allreduce as ar
from adasum_lightning.allreduce import adasum_allreduce
from adasum_lightning.reference import ADASUM_NORM_EPS
from tests.workers import cases as runner


def large(rank: int) -> torch.Tensor:
    """600,000 float32 (2.4 MB): more than two CPU chunks (2**18 elements each) per rank at N = 2."""
    return torch.randn(600_000, generator=torch.Generator().manual_seed(7 + rank))


def cases(rank: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """This rank's inputs of one dtype: named hard cases and random tensors of several shapes."""
    gen = torch.Generator().manual_seed(100 + 31 * rank)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)

    common = torch.linspace(-1.0, 2.0, 50, dtype=torch.float64)  # the same on every rank
    # float64: squared norm 1.6e-159, below sqrt(DBL_MIN) ≈ 1.5e-154 (coefficient forced to 1); float32
    # cannot get there except by zeros (its smallest subnormal squared is 2e-90): a subnormal instead.
    tiny = 1e-80 if dtype == torch.float64 else 1e-40
    out = {
        "random_7": randn(7),
        "random_33x5": randn(33, 5),
        "random_3x4x5": randn(3, 4, 5),
        "scalar": randn(),
        "empty": randn(0),
        "zero_on_rank0": torch.zeros(64, dtype=dtype) if rank == 0 else randn(64),
        "zero_everywhere": torch.zeros(9, dtype=dtype),
        "parallel": (common * (rank + 1)).to(dtype),
        "anti_parallel": (common * (-1.0) ** rank).to(dtype),
        "identical": common.to(dtype),
        "non_contiguous": randn(5, 33).t(),  # (33, 5), strides (1, 33)
    }
    if dtype in (torch.float32, torch.float64):
        out["tiny_on_rank1"] = torch.full((16,), tiny, dtype=dtype) if rank == 1 else randn(16)
        out["small_run"] = randn(5000)  # above SMALL_TENSOR: its own chunk
    return out


DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


PATHS = ("tree", "halving")


def reduce(
    tensors: Sequence[torch.Tensor], path: str, group: dist.ProcessGroup | None = None
) -> list[torch.Tensor]:
    """``adasum_allreduce`` forced through the binomial tree or Horovod's vector halving, whatever the
    bucket sizes, with Gloo messages of 64 KiB (the large tensors arrive and leave in many pieces, each
    chunk's products taken as its pieces arrive)."""
    with forced(path):
        return adasum_allreduce(tensors, group=group)


@contextmanager
def forced(path: str) -> Iterator[None]:
    """The allreduce forced through ``path`` (see :func:`reduce`) inside the block."""
    saved = ar.TREE_MAX_BYTES, ar.GLOO_PIECE_BYTES
    ar.TREE_MAX_BYTES = {"tree": 1 << 62, "halving": 0}[path]
    ar.GLOO_PIECE_BYTES = 1 << 16
    try:
        yield
    finally:
        ar.TREE_MAX_BYTES, ar.GLOO_PIECE_BYTES = saved


def final_ranges(rank: int, path: str, wire_dtype: torch.dtype | None = None) -> dict:
    """``adasum_allreduce_flat`` of :func:`large` with ``on_final``: the buffer after the call and each
    reported ``(start, length, the range's values when reported)``."""
    flat = large(rank)
    seen = []

    def on_final(start: int, length: int) -> None:
        seen.append((start, length, flat[start : start + length].clone()))

    with forced(path):
        ar.adasum_allreduce_flat(flat, [flat.numel()], on_final=on_final, wire_dtype=wire_dtype)
    return {"flat": flat, "seen": seen}


def wire_calls(rank: int, wire_dtype: torch.dtype) -> dict:
    """The float32 cases and :func:`large`, reduced with every sent piece rounded to ``wire_dtype``: as one
    flat buffer by ``adasum_allreduce_flat`` (each path) and ``mean_allreduce_flat``, as a list of the cases
    by ``adasum_allreduce``; the inputs and the results."""
    tensors = [t for t in cases(rank, torch.float32).values() if t.numel()] + [large(rank)]
    flat = torch.cat([t.reshape(-1) for t in tensors])
    counts = [t.numel() for t in tensors]
    out = {"inputs": tensors, "flat": {}}
    for path in PATHS:
        with forced(path):
            out["flat"][path] = ar.adasum_allreduce_flat(flat.clone(), counts, wire_dtype=wire_dtype)
    out["mean"] = ar.mean_allreduce_flat(flat.clone(), wire_dtype=wire_dtype)
    out["list"] = adasum_allreduce([t.clone() for t in tensors[:-1]], wire_dtype=wire_dtype)
    out["final_ranges"] = [final_ranges(rank, path, wire_dtype) for path in PATHS]
    return out


def all_cases_call(rank: int, path: str, group: dist.ProcessGroup | None = None) -> dict:
    """One call with every case, dtypes interleaved (float64, float32, float16, bfloat16, float64, …: four
    buckets) through ``path``; returns the order, the inputs and the outputs."""
    inputs = {str(dt): cases(rank, dt) for dt in DTYPES}
    order = [
        (dt, name) for name in inputs[str(torch.float64)] for dt in map(str, DTYPES) if name in inputs[dt]
    ]
    tensors = [inputs[dt][name].clone() for dt, name in order]
    strides_before = [t.stride() for t in tensors]
    returned = reduce(tensors, path, group)
    return {
        "order": order,
        "inputs": inputs,
        "outputs": {key: t for key, t in zip(order, tensors, strict=True)},
        "returned_same_list": returned is tensors,
        "strides_kept": [t.stride() for t in tensors] == strides_before,
    }


def gloo(out_dir: Path, prefix_groups: list[int]) -> None:
    runner.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    result = {"rank": rank, "size": size, "world": [all_cases_call(rank, path) for path in PATHS]}
    # A single contiguous tensor (reduced in its own memory), passed as a tuple; both paths.
    result["single_input"] = large(rank)
    result["single"], result["single_same_memory"] = [], []
    for path in PATHS:
        single = result["single_input"].clone()
        ptr = single.data_ptr()
        ret = reduce((single,), path)
        result["single"].append(single)
        result["single_same_memory"].append(single.data_ptr() == ptr and ret[0] is single)
    result["final_ranges"] = [final_ranges(rank, path) for path in PATHS]
    result["wire"] = {str(dt): wire_calls(rank, dt) for dt in (torch.bfloat16, torch.float16)}
    # A sub-group: ranks 1 … size-1 (rank 0 is not a member; it calls too and nothing happens).
    sub = dist.new_group(list(range(1, size)))
    sub_tensors = [
        cases(rank, torch.float64)["random_33x5"].clone(),
        cases(rank, torch.float32)["random_7"].clone(),
    ]
    result["sub_inputs"] = [t.clone() for t in sub_tensors]
    adasum_allreduce(sub_tensors, group=sub)  # the default path
    result["sub_outputs"] = sub_tensors
    # Groups of the first k ranks: world sizes k < size within one launch (every rank creates each group).
    result["prefix"] = {}
    for k in prefix_groups:
        group = dist.new_group(list(range(k)))
        result["prefix"][k] = [all_cases_call(rank, path, group) for path in PATHS] if rank < k else None
    dist.barrier()
    torch.save(result, out_dir / f"rank{rank}.pt")
    runner.destroy_process_group()


def horovod(out_dir: Path) -> None:
    import horovod.torch as hvd
    from lightning_fabric.plugins.environments.lightning import find_free_network_port

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    port = find_free_network_port() if rank == 0 else 0
    port = hvd.broadcast_object(port, root_rank=0, name="gloo_port")
    own_group = not dist.is_initialized()  # a Fabric horovod case of the same launch may have made one
    if own_group:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    inputs = {str(dt): cases(rank, dt) for dt in (torch.float32, torch.float64)}
    for per_dtype in inputs.values():
        del per_dtype["empty"]  # Horovod's Adasum of an empty tensor is not defined
    inputs["torch.float32"]["large"] = large(rank)
    order = [(dt, name) for dt, per_dtype in inputs.items() for name in per_dtype]
    horovod_out = {
        (dt, name): hvd.allreduce(inputs[dt][name].contiguous(), op=hvd.Adasum, name=f"{dt}.{name}")
        for dt, name in order
    }
    ours = {}
    for path in PATHS:
        tensors = [inputs[dt][name].clone() for dt, name in order]
        reduce(tensors, path)
        ours[path] = {key: t for key, t in zip(order, tensors, strict=True)}
    result = {
        "rank": rank,
        "size": size,
        "inputs": inputs,
        "horovod": horovod_out,
        "ours": ours,
        "eps": ADASUM_NORM_EPS,
    }
    torch.save(result, out_dir / f"rank{rank}.pt")
    if own_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    argv = runner.argv()
    out, mode = Path(argv[0]), argv[1]
    torch.set_num_threads(1)
    if mode == "gloo":
        gloo(out, [int(k) for k in argv[2:]])
    else:
        horovod(out)
