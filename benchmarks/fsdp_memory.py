"""Peak memory per rank and step time of ``fsdp_adasum`` beside Lightning's own HSDP on the same 2-D mesh.

``--impl``:

- ``fsdp_adasum``: ``Trainer(strategy=FSDPAdasumStrategy(shard_size=S), devices=N)``; ``configure_model``
  applies ``fully_shard(layer, mesh=self.device_mesh["shard"])`` to each ``Linear`` (the strategy then shards
  the root): FSDP2 inside each replica group, the groups' deltas combined by Adasum;
- ``hsdp``: ``Trainer(strategy=ModelParallelStrategy(data_parallel_size=N // S, tensor_parallel_size=S))``;
  ``configure_model`` applies ``fully_shard(layer, mesh=self.device_mesh)`` to each ``Linear`` and then to the
  MLP: on a 2-D mesh that is HSDP (replicate × shard), the gradients averaged over all ranks.

The model is ``benchmarks.loops``' MLP (784 → 4 × 2048 → 10, ReLU; 14.2 M parameters, 57 MB float32), SGD
lr 0.01 momentum 0.9, synthetic MNIST-shaped data in memory (batch 64 per rank, rank-specific), one
intra-op thread per process, Gloo. Each rank records its peak resident memory twice: the whole process's
(``ru_maxrss``, which includes building the unsharded model) and the peak while training (Linux's
``VmHWM`` after resetting it through ``/proc/self/clear_refs`` when training starts, the model sharded and
the optimizer built); rank 0 times the steps from ``--skip`` on. Deterministic beside these, at the end of
training: the bytes of this rank's shards of the parameters, and (``fsdp_adasum``) the bytes of the buffers
the Adasum step keeps between steps (``adasum_lightning.sharded``'s workspace slots) and of the float64
chunk scratch of its statistics (slots ``work64``, ``out64``, bounded by the chunk size, not the model).

usage: python -m benchmarks.fsdp_memory OUT.json --impl fsdp_adasum|hsdp --devices N --shard-size S
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.loops import BATCH, LR, MOMENTUM, make_model

IMPLS = ("fsdp_adasum", "hsdp")


def status_kb(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> bool:
    """Reset this process's ``VmHWM`` to its current resident size (Linux ≥ 4.0); False where refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def kept_buffers(module: nn.Module) -> dict[str, int]:
    """This rank's bytes of the parameters' local shards (``to_local()`` of FSDP2's ``DTensor``), and of the
    buffers the Adasum step keeps for this thread: its own slots (θ_before, the scratch for parameters
    without a gradient) and the float64 chunk scratch."""
    from torch.distributed.tensor import DTensor

    from adasum_lightning import allreduce
    from adasum_lightning.sharded import _step_buffer_bytes

    shard = sum(
        (q.to_local() if isinstance(q, DTensor) else q).numel() * q.element_size()
        for q in module.parameters()
    )
    scratch = sum(
        buf.numel() * buf.element_size()
        for key, buf in allreduce._workspace.__dict__.items()
        if key.split("|")[0] in ("work64", "out64")
    )
    return {
        "parameter_shard_bytes": shard,
        "step_buffer_bytes": _step_buffer_bytes(),
        "float64_scratch_bytes": scratch,
    }


def rank_data(steps: int, rank: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(rank)
    n = steps * BATCH
    return TensorDataset(torch.randn(n, 1, 28, 28, generator=gen), torch.randint(0, 10, (n,), generator=gen))


def run(impl: str, devices: int, shard_size: int, steps: int, skip: int) -> dict:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import Callback
    from pytorch_lightning.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    from adasum_lightning.trainer import FSDPAdasumStrategy

    clock = {"start": 0.0, "end": 0.0, "steps": 0}
    memory: dict[str, int | bool] = {}

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = make_model("mlp")

        def configure_model(self) -> None:
            mesh = self.device_mesh["shard"] if impl == "fsdp_adasum" else self.device_mesh
            for layer in self.model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            if impl == "hsdp":
                fully_shard(self.model, mesh=mesh)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.nll_loss(self.model(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)

        def train_dataloader(self):
            return DataLoader(rank_data(steps, self.global_rank), batch_size=BATCH)

    class Measure(Callback):
        def on_train_start(self, trainer, pl_module):
            memory["rss_at_train_start_kb"] = status_kb("VmRSS")
            memory["peak_reset"] = reset_peak()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == skip:
                clock["start"] = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx >= skip:
                clock["end"], clock["steps"] = time.perf_counter(), clock["steps"] + 1

        def on_train_end(self, trainer, pl_module):  # before the strategy's teardown frees the buffers
            memory.update(kept_buffers(pl_module))

    if impl == "fsdp_adasum":
        strategy = FSDPAdasumStrategy(shard_size=shard_size)
    else:
        strategy = ModelParallelStrategy(
            data_parallel_size=devices // shard_size, tensor_parallel_size=shard_size
        )
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, callbacks=[Measure()],
    )  # fmt: skip
    trainer.fit(Module())
    memory["training_peak_kb"] = status_kb("VmHWM")
    memory["process_peak_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"clock": clock, "memory": memory}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--impl", choices=IMPLS, required=True)
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--shard-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=30, help="steps per process, warm-up included")
    p.add_argument("--skip", type=int, default=5, help="untimed warm-up steps")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    mine = run(args.impl, args.devices, args.shard_size, args.steps, args.skip)
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, mine["memory"])
    if dist.get_rank() == 0:
        clock = mine["clock"]
        parameters = sum(q.numel() for q in make_model("mlp").parameters())
        mb = [r["training_peak_kb"] / 1024 for r in per_rank]
        result = {
            "impl": args.impl,
            "world_size": dist.get_world_size(),
            "shard_size": args.shard_size,
            "replica_groups": dist.get_world_size() // args.shard_size,
            "parameters": parameters,
            "parameter_mb": parameters * 4 / 2**20,
            "parameter_shard_mb": parameters * 4 / 2**20 / args.shard_size,
            "steps": clock["steps"],
            "seconds": clock["end"] - clock["start"],
            "ms_per_step": 1e3 * (clock["end"] - clock["start"]) / clock["steps"],
            "training_peak_rss_mb_per_rank": mb,
            "process_peak_rss_mb_per_rank": [r["process_peak_kb"] / 1024 for r in per_rank],
            "rss_at_train_start_mb_per_rank": [r["rss_at_train_start_kb"] / 1024 for r in per_rank],
            "peak_reset": all(r["peak_reset"] for r in per_rank),
            "parameter_shard_bytes_per_rank": [r["parameter_shard_bytes"] for r in per_rank],
            "step_buffer_bytes_per_rank": [r["step_buffer_bytes"] for r in per_rank],
            "step_buffer_shards_per_rank": [
                r["step_buffer_bytes"] / r["parameter_shard_bytes"] for r in per_rank
            ],
            "float64_scratch_bytes_per_rank": [r["float64_scratch_bytes"] for r in per_rank],
            "batch_size": BATCH,
        }
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
