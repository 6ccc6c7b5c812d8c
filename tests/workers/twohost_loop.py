"""Worker: the elastic recipe of docs/elastic.md in a Fabric loop or a plain loop with ``AdasumOptimizer``,
started by ``torchrun``; every rank saves what it saw to ``OUT_DIR/rank{r}.pt`` (as ``twohost_ddp`` does).

usage: python -m tests.workers.twohost_loop OUT_DIR --form fabric|plain --max-steps N --checkpoint-every K
    [--step-seconds T] [--pg-timeout S] [--samples N]

The checkpoint is ``OUT_DIR/checkpoints/last.ckpt`` (the model, the optimizer, the step and the epoch),
written by rank 0 every K steps (``fabric.save``; in the plain loop ``torch.save`` to a temporary name,
renamed) and loaded at the start when it exists. The data is a ``DistributedSampler`` shard (seed 100) of
``IndexedData``, batches of 4; a resumed epoch starts over for the new world. Each rank appends
``pid global_step time`` to ``OUT_DIR/progress-rank{r}`` and writes ``OUT_DIR/step-rank{r}`` after every step.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from adasum_lightning import AdasumOptimizer
from adasum_lightning.fabric import DDPAdasumStrategy
from tests.workers.samples import IndexedData, tiny_net


def progress(out: Path, rank: int, step: int, started: float, step_seconds: float) -> None:
    time.sleep(max(0.0, step_seconds - (time.monotonic() - started)))
    (out / f"step-rank{rank}.tmp").write_text(str(step))
    os.replace(out / f"step-rank{rank}.tmp", out / f"step-rank{rank}")
    with (out / f"progress-rank{rank}").open("a") as f:
        f.write(f"{os.getpid()} {step} {time.time():.3f}\n")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--form", choices=("fabric", "plain"), required=True)
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--checkpoint-every", type=int, required=True)
    p.add_argument("--step-seconds", type=float, default=0.0)
    p.add_argument("--pg-timeout", type=float, default=15.0)
    p.add_argument("--samples", type=int, default=64)
    args = p.parse_args()
    out, timeout = Path(args.out), datetime.timedelta(seconds=args.pg_timeout)
    path = out / "checkpoints" / "last.ckpt"
    torch.set_num_threads(1)
    torch.manual_seed(1000 + int(os.environ["RANK"]))  # other initial weights per rank: rank 0's are taken
    data = IndexedData(args.samples)
    model = tiny_net()
    if args.form == "fabric":
        import lightning_fabric as lf

        local_size = int(os.environ["LOCAL_WORLD_SIZE"])
        fabric = lf.Fabric(
            accelerator="cpu",
            strategy=DDPAdasumStrategy(timeout=timeout),
            devices=local_size,
            num_nodes=int(os.environ["WORLD_SIZE"]) // local_size,
        )
        fabric.launch()
        lf.seed_everything(100)  # Fabric's DistributedSampler takes its seed from PL_GLOBAL_SEED
        model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5))
        loader = fabric.setup_dataloaders(DataLoader(data, batch_size=4, shuffle=True))
        sampler, rank, world_size = loader.sampler, fabric.global_rank, fabric.world_size
        state = {"model": model, "optimizer": optimizer, "step": 0, "epoch": 0}
        if path.exists():
            fabric.load(path, state)  # rank 0 prints where it resumed

        def save() -> None:
            fabric.save(path, state)
    else:
        dist.init_process_group("gloo", timeout=timeout)
        rank, world_size = dist.get_rank(), dist.get_world_size()
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
        optimizer = AdasumOptimizer(sgd, timeout=timeout)  # its exchanges' limit (default: 30 minutes)
        sampler = DistributedSampler(data, shuffle=True, seed=100)
        loader = DataLoader(data, batch_size=4, sampler=sampler)
        state = {"step": 0, "epoch": 0}
        if path.exists():
            saved = torch.load(path, weights_only=False)
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            state.update(step=saved["step"], epoch=saved["epoch"])
            if rank == 0:
                print(
                    f"plain loop: resumed from {path} at step {saved['step']} (world size "
                    f"{saved['world_size']} -> {world_size}; torchrun restart "
                    f"{os.environ.get('TORCHELASTIC_RESTART_COUNT')})",
                    flush=True,
                )

        def save() -> None:
            if rank == 0:
                path.parent.mkdir(exist_ok=True)
                saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), **state}
                torch.save({**saved, "world_size": world_size}, f"{path}.tmp")
                os.replace(f"{path}.tmp", path)

    indices, start = [], {k: v.detach().clone() for k, v in model.state_dict().items()}
    while state["step"] < args.max_steps:
        sampler.set_epoch(state["epoch"])
        for x, y, idx in loader:
            started = time.monotonic()
            indices += idx.tolist()
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            if args.form == "fabric":
                fabric.backward(loss)
            else:
                loss.backward()
            optimizer.step()
            state["step"] += 1
            progress(out, rank, state["step"], started, args.step_seconds)
            if state["step"] % args.checkpoint_every == 0:
                save()
            if state["step"] == args.max_steps:
                break
        else:
            state["epoch"] += 1
    record = {
        "host": socket.gethostname(),
        "trainer": {"global_rank": rank, "world_size": world_size, "global_step": state["step"]},
        "indices": indices,
        "start": start,
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }
    torch.save(record, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
