"""Worker: the same short training in one of the three forms of Adasum; every rank saves OUT/rank{r}.pt.

usage: python -m tests.workers.forms OUT --form {plain,fabric,trainer} [options]

- ``plain``: a plain ``torch.distributed`` loop with :class:`adasum_lightning.AdasumOptimizer` (start it
  with ``torchrun``); imports no Lightning package.
- ``fabric``: ``Fabric(strategy="ddp_adasum", devices=N)`` and ``fabric.launch()`` (started as a plain
  python); the Fabric package is ``--fabric-package`` (``lightning_fabric`` or ``lightning.fabric``).
- ``trainer``: ``Trainer(strategy="ddp_adasum", devices=N)`` on ``TinyModule`` (Lightning starts the
  processes); a callback and the module record the parameters they see at the end of each epoch and of fit.

All three: the tiny net, rank 0's initial weights (seed 100; the other ranks seed differently), 64 samples
in per-rank shards of a shuffling ``DistributedSampler`` (rank 0's seed, a new order each epoch), batches of
4, ``--epochs`` epochs, the loss divided by ``--accumulate`` and a step every ``--accumulate`` batches (and
at an epoch's last batch, as Lightning does), optional norm clipping, and fp16 with a ``GradScaler`` whose
step ``--inf-rank`` skips at optimizer step ``--inf-step`` (an infinite loss on that rank only).
"""

import argparse
import functools
import importlib
import os
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from tests.workers import cases
from tests.workers.samples import IndexedData, tiny_net

FABRIC_PACKAGES = ("lightning_fabric", "lightning.fabric")
p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--form", required=True, choices=("plain", "fabric", "trainer"))
p.add_argument("--devices", type=int, default=2)
p.add_argument("--fabric-package", default="lightning_fabric", choices=FABRIC_PACKAGES)
p.add_argument("--optimizer", default="sgd", choices=("sgd", "adam", "lbfgs"))
p.add_argument("--lr", type=float, default=0.1)
p.add_argument("--momentum", type=float, default=0.5)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--max-steps", type=int, default=-1, help="plain, trainer: stop after this many steps")
p.add_argument("--accumulate", type=int, default=1)
p.add_argument("--clip-norm", type=float, default=None)
p.add_argument("--fp16-scaler", action="store_true")
p.add_argument("--bf16", action="store_true", help="bf16-mixed (autocast to bfloat16)")
p.add_argument("--clip-value", type=float, default=None)
p.add_argument(
    "--fabric-instance", action="store_true", help="fabric: a strategy object, setup_module/_optimizers"
)
p.add_argument("--inf-rank", type=int, default=-1)
p.add_argument("--inf-step", type=int, default=-1)
p.add_argument("--save-load", action="store_true", help="fabric: save at the end, load into fresh objects")
p.add_argument("--ddp-wrapped", action="store_true", help="the model wrapped in DistributedDataParallel")
p.add_argument("--sync-every", type=int, default=1, help="local SGD: optimizer steps between syncs")
p.add_argument("--combine", default="adasum", choices=("adasum", "mean"))
p.add_argument("--outer-lr", type=float, default=0.0, help="> 0: an outer Nesterov SGD (momentum 0.9)")
p.add_argument("--compression", default=None, choices=("bf16", "fp16"), help="the wire dtype of the combine")
p.add_argument("--overlap-sync", action="store_true", help="local SGD: each exchange behind the next window")
args = p.parse_args(cases.argv())
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)

RANK_VARIABLES = ("RANK", "LOCAL_RANK")
START_RANK = int(next((os.environ[v] for v in RANK_VARIABLES if os.environ.get(v)), "0"))
SAMPLES, BATCH = 64, 4


def make_optimizer(params):
    if args.optimizer == "lbfgs":
        return torch.optim.LBFGS(params, lr=args.lr, max_iter=5)
    if args.optimizer == "adam":
        return torch.optim.Adam(params, lr=args.lr)
    return torch.optim.SGD(params, lr=args.lr, momentum=args.momentum)


def local_sgd() -> dict:
    """The local-SGD and compression arguments of AdasumOptimizer and of the strategies (empty: every step,
    no compression)."""
    wire = {"compression": args.compression} if args.compression else {}
    if args.sync_every == 1 and args.combine == "adasum" and not args.outer_lr:
        return wire
    outer = None
    if args.outer_lr:
        outer = functools.partial(torch.optim.SGD, lr=args.outer_lr, momentum=0.9, nesterov=True)
    overlap = {"overlap_sync": True} if args.overlap_sync else {}
    return {"sync_every": args.sync_every, "combine": args.combine, "outer_optimizer": outer,
            **wire, **overlap}  # fmt: skip


def dataset() -> IndexedData:
    return IndexedData(SAMPLES)


def is_step_batch(i: int, batches: int) -> bool:
    return (i + 1) % args.accumulate == 0 or i + 1 == batches


def loss_of(model, x, y, rank: int, step: int) -> torch.Tensor:
    loss = F.cross_entropy(model(x), y)
    if rank == args.inf_rank and step == args.inf_step:
        loss = loss * float("inf")  # overflowing gradients on this rank only: the scaler skips its step
    return loss / args.accumulate


def closure(optimizer, model, x, y, backward=torch.Tensor.backward) -> torch.Tensor:
    # what Lightning's closure does for a closure optimizer: zero_grad, forward, backward
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    backward(loss)
    return loss


def parameters_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k.removeprefix("net."): v.detach().clone() for k, v in model.state_dict().items()}


def save(rank: int, model: torch.nn.Module, optimizer, **extra) -> None:
    end = parameters_of(model)
    state = optimizer.state_dict()["state"]
    opt_state = {k: {n: t.clone() for n, t in s.items() if torch.is_tensor(t)} for k, s in state.items()}
    torch.save({"end": end, "opt_state": opt_state, **extra}, out / f"rank{rank}.pt")


def run_plain() -> None:
    import sys

    import torch.distributed as dist

    from adasum_lightning import AdasumOptimizer

    cases.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(100 + rank)
    model = tiny_net()
    # what a DDP script becomes when only its optimizer is changed: the wrapper averages the gradients
    net = torch.nn.parallel.DistributedDataParallel(model) if args.ddp_wrapped else model
    options = local_sgd()
    if options.get("outer_optimizer") is not None:
        options["outer_optimizer"] = options["outer_optimizer"](net.parameters())
    optimizer = AdasumOptimizer(make_optimizer(net.parameters()), **options)
    trace = []  # this rank's parameters after every step
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}  # rank 0's, after the broadcast
    with warnings.catch_warnings(record=True) as warned:  # AdasumOptimizer's, on this rank
        warnings.simplefilter("always")
        scaler = torch.amp.GradScaler("cpu", enabled=args.fp16_scaler)
        # Lightning's own sharding: shuffled with rank 0's seed, a new order every epoch
        sampler = DistributedSampler(dataset(), world, rank, shuffle=True, seed=100)
        loader = DataLoader(dataset(), batch_size=BATCH, sampler=sampler)
        step, first_batch = 0, next(iter(loader))[2]
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            for i, (x, y, _) in enumerate(loader):
                if step == args.max_steps:
                    break
                if args.optimizer == "lbfgs":
                    optimizer.step(functools.partial(closure, optimizer, model, x, y))
                    step += 1
                    continue
                autocast = torch.bfloat16 if args.bf16 else torch.float16
                with torch.autocast("cpu", dtype=autocast, enabled=args.fp16_scaler or args.bf16):
                    loss = loss_of(net, x, y, rank, step)
                scaler.scale(loss).backward()
                if is_step_batch(i, len(loader)):
                    if args.clip_norm is not None:
                        scaler.unscale_(optimizer)
                        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_norm)
                    if args.clip_value is not None:
                        torch.nn.utils.clip_grad_value_(model.parameters(), args.clip_value)
                    scaler.step(optimizer)
                    scaler.update()
                    optimizer.zero_grad()
                    step += 1
                    trace.append(torch.cat([q.detach().reshape(-1) for q in model.parameters()]))
    optimizer.sync()  # the Trainer's and Fabric's windows end with fit / at the save
    lightning = sorted(m for m in ("lightning", "pytorch_lightning", "lightning_fabric") if m in sys.modules)
    save(rank, model, optimizer, world_size=world, steps=step, lightning_imported=lightning, start=start,
         first_batch=first_batch, warned=[str(w.message) for w in warned], trace=trace)  # fmt: skip
    cases.destroy_process_group()


def run_fabric() -> None:
    fabric_module = importlib.import_module(args.fabric_package)
    precision = importlib.import_module(f"{args.fabric_package}.plugins.precision")

    import adasum_lightning  # noqa: F401  (registers ddp_adasum with both Fabric registries)

    plugins = None
    if args.fp16_scaler:  # on CPU Fabric turns "16-mixed" into bf16-mixed; the plugin keeps fp16 and a scaler
        plugins = [precision.MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]
    strategy = "ddp_adasum"
    if args.fabric_instance or local_sgd():
        copy = (
            "adasum_lightning.fabric"
            if args.fabric_package == "lightning_fabric"
            else "adasum_lightning.lightning.fabric"
        )
        strategy = importlib.import_module(copy).DDPAdasumStrategy(**local_sgd())
    fabric = fabric_module.Fabric(
        accelerator="cpu", devices=args.devices, strategy=strategy, plugins=plugins,
        precision="bf16-mixed" if args.bf16 else None,
    )  # fmt: skip
    fabric.launch()
    rank = fabric.global_rank
    fabric.seed_everything(100 + rank)
    model = tiny_net()
    if args.ddp_wrapped:
        model = torch.nn.parallel.DistributedDataParallel(model)
    if args.fabric_instance:  # the two-call form
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(make_optimizer(model.parameters()))
    else:
        model, optimizer = fabric.setup(model, make_optimizer(model.parameters()))
    loader = fabric.setup_dataloaders(DataLoader(dataset(), batch_size=BATCH, shuffle=True))
    step = 0
    for _epoch in range(args.epochs):
        for i, (x, y, _) in enumerate(loader):
            if args.optimizer == "lbfgs":
                optimizer.step(functools.partial(closure, optimizer, model, x, y, fabric.backward))
                step += 1
                continue
            stepping = is_step_batch(i, len(loader))
            with fabric.no_backward_sync(model, enabled=not stepping):
                fabric.backward(loss_of(model, x, y, rank, step))
            if stepping:
                if args.clip_norm is not None:
                    fabric.clip_gradients(model, optimizer, max_norm=args.clip_norm)
                if args.clip_value is not None:
                    fabric.clip_gradients(model, optimizer, clip_val=args.clip_value)
                optimizer.step()
                optimizer.zero_grad()
                step += 1
    fabric.strategy.end_windows()
    extra = {
        "world_size": fabric.world_size,
        "steps": step,
        "strategy": type(fabric.strategy).__module__ + "." + type(fabric.strategy).__name__,
        # the collectives, on every rank: rank r contributes r + 1
        "all_gather": fabric.all_gather(torch.tensor([rank + 1.0])).flatten().tolist(),
        "all_reduce_sum": fabric.all_reduce(torch.tensor(rank + 1.0), reduce_op="sum").item(),
        "broadcast": fabric.broadcast(f"from rank {rank}", src=0),
    }
    fabric.barrier()
    if args.save_load:
        checkpoint = out / "fabric.ckpt"
        fabric.save(checkpoint, {"model": model, "optimizer": optimizer, "step": step})
        torch.manual_seed(7 + rank)  # fresh objects that differ on every rank until loaded
        fresh = tiny_net()
        fresh, fresh_optimizer = fabric.setup(fresh, make_optimizer(fresh.parameters()))
        state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
        fabric.load(checkpoint, state)
        extra["loaded_step"] = state["step"]
        extra["loaded"] = {k: v.detach().clone() for k, v in fresh.state_dict().items()}
        loaded_state = fresh_optimizer.state_dict()["state"]
        extra["loaded_opt_state"] = {
            k: {n: t.clone() for n, t in s.items() if torch.is_tensor(t)} for k, s in loaded_state.items()
        }
    save(rank, model, optimizer, **extra)


def run_trainer() -> None:
    from tests.workers.lightning import DDPAdasumStrategy, pl
    from tests.workers.tiny import TinyModule

    exits = {}  # the parameters a callback and the module see where fit ends

    class RecordExits(pl.Callback):
        def on_train_epoch_end(self, trainer, module):
            exits[f"callback.on_train_epoch_end.{trainer.current_epoch}"] = parameters_of(module)

        def on_train_end(self, trainer, module):
            exits["callback.on_train_end"] = parameters_of(module)

    class Module(TinyModule):
        def on_train_epoch_end(self):
            exits[f"module.on_train_epoch_end.{self.current_epoch}"] = parameters_of(self)

        def on_train_end(self):
            exits["module.on_train_end"] = parameters_of(self)

    pl.seed_everything(100 + START_RANK)
    module = Module(lr=args.lr, momentum=args.momentum, optimizer=args.optimizer, n=SAMPLES,
                    batch_size=BATCH, inf_rank=args.inf_rank, inf_step=args.inf_step)  # fmt: skip
    plugins = None
    if args.fp16_scaler:
        plugins = [pl.plugins.precision.MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]
    trainer = pl.Trainer(
        strategy=DDPAdasumStrategy(**local_sgd()) if local_sgd() else "ddp_adasum",
        accelerator="cpu",
        devices=args.devices,
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        callbacks=[RecordExits()],
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=args.clip_norm if args.clip_value is None else args.clip_value,
        gradient_clip_algorithm="norm" if args.clip_value is None else "value",
        precision="bf16-mixed" if args.bf16 else None,
        plugins=plugins,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(module)
    save(trainer.global_rank, module, trainer.optimizers[0], world_size=trainer.world_size,
         steps=trainer.global_step, indices=module.record["indices"], exits=exits,
         start={k.removeprefix("net."): v for k, v in module.record["start"].items()})  # fmt: skip


{"plain": run_plain, "fabric": run_fabric, "trainer": run_trainer}[args.form]()
