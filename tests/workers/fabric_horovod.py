"""Worker: ``Fabric(strategy="horovod_adasum")`` and ``Fabric(strategy="horovod")`` under ``horovodrun``.

usage: python -m tests.workers.fabric_horovod OUT --jobs GROUP[,GROUP...]

Each group is a list of scenarios run one after the other in this process, each with its own ``Fabric``
(Horovod and the ``torch.distributed`` process group are initialised by the first and kept):

- ``train``: one step of the tiny net (SGD, momentum 0.5) with ``horovod_adasum`` by name and as an instance
  for each Fabric package name, ``horovod`` (averaging, lr × world size), ``horovod`` with norm clipping,
  ``horovod`` with LBFGS (a closure), ``horovod_adasum`` accumulating two backward passes, and
  ``fabric.save``/``fabric.load``;
- ``refusals``: configurations the strategies refuse, each caught here (after the strategy printed it);
- ``world``, ``gloo``, ``alone``: the refusals that need their own launch (3 ranks; ``horovodrun --gloo``,
  where ``horovod`` then trains; a plain ``python`` start with ``HOROVOD_CPU_OPERATIONS=gloo``).

Every rank saves ``{scenario: record}`` to ``OUT/rank{r}.pt``.
"""

from __future__ import annotations

import argparse
import importlib
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from adasum_lightning.errors import AdasumConfigurationError
from adasum_lightning.launch_environment import launcher_rank
from tests.workers import cases
from tests.workers.samples import IndexedData, tiny_net

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--jobs", required=True)
args = p.parse_args(cases.argv())
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
if "alone" in args.jobs.split(","):
    os.environ["HOROVOD_CPU_OPERATIONS"] = "gloo"  # read by Horovod when it initialises

import adasum_lightning  # noqa: E402,F401  (registers the strategy names with both Fabric registries)

RANK = launcher_rank()
LR, MOMENTUM, BATCH, LBFGS_LR = 0.1, 0.5, 4, 0.25
#: This project's Fabric strategies for each Fabric package.
COPIES = {
    "lightning_fabric": "adasum_lightning.fabric",
    "lightning.fabric": "adasum_lightning.lightning.fabric",
}
records: dict[str, dict] = {}


def fabric_for(strategy, package: str = "lightning_fabric", by: str = "name", **kwargs):
    """A launched Fabric of ``package`` with ``strategy`` given by name or as an instance of its class."""
    if by == "instance":
        cls = {"horovod_adasum": "HorovodAdasumStrategy", "horovod": "HorovodStrategy"}[strategy]
        strategy = getattr(importlib.import_module(COPIES[package]), cls)(**kwargs.pop("strategy_kwargs", {}))
    fabric = importlib.import_module(package).Fabric(accelerator="cpu", strategy=strategy, **kwargs)
    fabric.launch()
    return fabric


def state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def one_step(fabric, *, accumulate: int = 1, clip_norm: float | None = None, optimizer_cls=torch.optim.SGD):
    """Rank 0's weights, ``accumulate`` backward passes (the first ones under no_backward_sync), one step."""
    rank = fabric.global_rank
    fabric.seed_everything(100 + rank, verbose=False)  # every rank its own initial weights
    model = tiny_net()
    init = state(model)
    model, optimizer = fabric.setup(model, optimizer_cls(model.parameters(), lr=LR, momentum=MOMENTUM))
    start = state(model)
    loader = fabric.setup_dataloaders(DataLoader(IndexedData(), batch_size=BATCH, shuffle=True))
    batches, indices = [], []
    for i, (x, y, idx) in enumerate(loader):
        if i == accumulate:
            break
        with fabric.no_backward_sync(model, enabled=i < accumulate - 1):
            fabric.backward(F.cross_entropy(model(x), y) / accumulate)
        batches.append((x, y))
        indices += idx.tolist()
    norm = None
    if clip_norm is not None:
        norm = fabric.clip_gradients(model, optimizer, max_norm=clip_norm).item()
    optimizer.step()
    optimizer.zero_grad()
    return (
        model,
        optimizer,
        {
            "init": init,
            "start": start,
            "end": state(model),
            "batches": batches,
            "indices": indices,
            "norm": norm,
            "lr": optimizer.param_groups[0]["lr"],
            "world_size": fabric.world_size,
            "strategy": type(fabric.strategy).__module__ + "." + type(fabric.strategy).__name__,
            "base": [c.__module__ + "." + c.__name__ for c in type(fabric.strategy).__mro__],
            # the collectives, on every rank: rank r contributes r + 1
            "all_gather": fabric.all_gather(torch.tensor([rank + 1.0])).flatten().tolist(),
            "all_reduce_sum": fabric.all_reduce(torch.tensor(rank + 1.0), reduce_op="sum").item(),
            "all_reduce_mean": fabric.all_reduce(torch.tensor(rank + 1.0)).item(),
            "broadcast": fabric.broadcast(f"from rank {rank}", src=0),
        },
    )


def lbfgs_step(fabric) -> dict:
    """One LBFGS step (a closure evaluated several times) on rank 0's weights and this rank's first batch."""
    fabric.seed_everything(100 + fabric.global_rank, verbose=False)
    model = tiny_net()
    model, optimizer = fabric.setup(model, torch.optim.LBFGS(model.parameters(), lr=LBFGS_LR, max_iter=3))
    start = state(model)
    x, y, _ = next(iter(fabric.setup_dataloaders(DataLoader(IndexedData(), batch_size=BATCH, shuffle=True))))

    def closure():
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        fabric.backward(loss)
        return loss

    loss = optimizer.step(closure)
    return {"start": start, "end": state(model), "batches": [(x, y)], "loss": loss.item()}


def momentum_buffers(optimizer) -> dict:
    return {k: s["momentum_buffer"].clone() for k, s in optimizer.state_dict()["state"].items()}


def save_and_load() -> dict:
    fabric = fabric_for("horovod_adasum")
    model, optimizer, record = one_step(fabric)
    checkpoint = out / "fabric.ckpt"
    record["saved_momentum"] = momentum_buffers(optimizer)
    fabric.save(checkpoint, {"model": model, "optimizer": optimizer, "step": 1})
    torch.manual_seed(7 + fabric.global_rank)  # fresh objects that differ on every rank until loaded
    fresh = tiny_net()
    fresh, fresh_optimizer = fabric.setup(
        fresh, torch.optim.SGD(fresh.parameters(), lr=LR, momentum=MOMENTUM)
    )
    loaded = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
    fabric.load(checkpoint, loaded)
    record.update(
        loaded_step=loaded["step"], loaded=state(fresh), loaded_momentum=momentum_buffers(fresh_optimizer)
    )
    return record


def train() -> None:
    for package in ("lightning_fabric", "lightning.fabric"):
        for by in ("name", "instance"):
            records[f"adasum/{package}/{by}"] = one_step(fabric_for("horovod_adasum", package, by))[2]
    records["horovod"] = one_step(fabric_for("horovod"))[2]
    records["horovod/clip"] = one_step(fabric_for("horovod"), clip_norm=0.05)[2]
    records["horovod/lbfgs"] = lbfgs_step(fabric_for("horovod"))
    accumulating = fabric_for(
        "horovod_adasum", by="instance", strategy_kwargs={"backward_passes_per_step": 2}
    )
    records["adasum/accumulate"] = one_step(accumulating, accumulate=2)[2]
    records["adasum/save_load"] = save_and_load()


def refused(name: str, scenario) -> None:
    """Run ``scenario(seen)``; record the refusal's message (None if nothing was refused) and what it saw."""
    seen: dict = {}
    try:
        scenario(seen)
    except AdasumConfigurationError as err:
        seen["message"] = str(err)
    else:
        seen["message"] = None
    if "model" in seen:
        seen["after"] = state(seen.pop("model"))
    records[name] = seen


def set_up(fabric, seen: dict, optimizer_cls=torch.optim.SGD, **optimizer_kwargs):
    model = tiny_net()
    model, optimizer = fabric.setup(model, optimizer_cls(model.parameters(), lr=LR, **optimizer_kwargs))
    seen.update(start=state(model), model=model)
    return model, optimizer


def backward(fabric, model) -> None:
    x, y, _ = IndexedData()[RANK * BATCH : (RANK + 1) * BATCH]
    fabric.backward(F.cross_entropy(model(x), y))


def predivide(seen: dict) -> None:
    fabric_for("horovod_adasum", by="instance", strategy_kwargs={"gradient_predivide_factor": 2.0})


def fp16_scaler(seen: dict) -> None:
    precision = importlib.import_module("lightning_fabric.plugins.precision")
    plugin = precision.MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    fabric_for("horovod_adasum", plugins=[plugin])


def lbfgs(seen: dict) -> None:
    fabric = fabric_for("horovod_adasum")
    model = tiny_net()
    seen["model"] = model
    fabric.setup(model, torch.optim.LBFGS(model.parameters(), lr=LR))


def skipped_sync(strategy: str, passes_per_step: int, skips: int):
    def scenario(seen: dict) -> None:
        fabric = fabric_for(
            strategy, by="instance", strategy_kwargs={"backward_passes_per_step": passes_per_step}
        )
        model, optimizer = set_up(fabric, seen)
        for _ in range(skips):
            with fabric.no_backward_sync(model):
                backward(fabric, model)
            seen["passes"] = seen.get("passes", 0) + 1
        seen["stepped"] = True
        optimizer.step()

    return scenario


def clipping(**clip_kwargs):
    def scenario(seen: dict) -> None:
        fabric = fabric_for("horovod_adasum")
        model, optimizer = set_up(fabric, seen, momentum=MOMENTUM)
        backward(fabric, model)
        fabric.clip_gradients(model, optimizer, **clip_kwargs)
        seen["stepped"] = True
        optimizer.step()

    return scenario


def refusals() -> None:
    refused("predivide", predivide)
    refused("fp16", fp16_scaler)
    refused("lbfgs", lbfgs)
    refused("sync/adasum", skipped_sync("horovod_adasum", 1, 1))
    refused("sync/horovod", skipped_sync("horovod", 2, 2))
    refused("clip/norm", clipping(max_norm=1.0))
    refused("clip/value", clipping(clip_val=0.5))


def world() -> None:
    refused("world", lambda seen: fabric_for("horovod_adasum"))


def gloo() -> None:
    refused("controller", lambda seen: fabric_for("horovod_adasum"))
    records["horovod"] = one_step(fabric_for("horovod"))[2]


def alone() -> None:
    refused("launch", lambda seen: fabric_for("horovod_adasum", devices=2))
    refused("cpu_operations/horovod_adasum", lambda seen: fabric_for("horovod_adasum"))
    refused("cpu_operations/horovod", lambda seen: fabric_for("horovod"))


GROUPS = {"train": train, "refusals": refusals, "world": world, "gloo": gloo, "alone": alone}
for group in args.jobs.split(","):
    GROUPS[group]()
torch.save(records, out / f"rank{RANK}.pt")
