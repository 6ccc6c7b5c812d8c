"""Simulate N data-parallel Horovod workers in one process: Adasum or averaging, no MPI needed.

A research tool of this repository (``make bench`` and the tests use it; it is not in the package). Use
it, from a checkout, to see how Adasum and gradient averaging compare for *your* LightningModule at 8, 16,
64 workers::

    from benchmarks.simulate import simulate

    pl.seed_everything(42)                     # the initial weights, as rank 0 would draw them
    result = simulate(MyModule(), train_set, num_workers=16, method="adasum", batch_size=32,
                      max_epochs=5, val_dataset=val_set, target=0.99)
    result.epochs_to_target, result.history[-1]["val_acc"]

What one simulated step does (``W`` workers, common parameters ``θ``):

- ``method="adasum"`` — Horovod's ``_DistributedAdasumOptimizer`` (``horovod/torch/optimizer.py``):
  every worker ``w`` takes its own batch, runs ``training_step`` + backward from ``θ``, then *its own*
  optimizer (own state, e.g. momentum from its local gradients; own LR scheduler) steps, giving
  ``θ_w``; the deltas ``d_w = θ_w − θ`` (float32 subtraction, as Horovod does) are combined per
  parameter tensor with :func:`adasum_lightning.reference.adasum_reduce` (pairwise, as Horovod's recursive
  vector-halving pairs ranks; Maleki et al., MLSys 2021) and ``θ ← θ + adasum(d_0 … d_{W−1})``.
  The learning rate is multiplied by ``lr_factor`` (default 1, as ``horovod_adasum`` on CPU).
- ``method="average"`` — Horovod's ``_DistributedOptimizer`` with ``op=Average``: the workers'
  gradients from ``θ`` are summed neighbours first, ``(g_0 + g_1) + (g_2 + g_3)`` (the order of the
  recursive-doubling allreduce Open MPI used in the validation runs), divided by W, and one optimizer
  (state shared: identical on every rank in the real job) steps with the learning rate × ``lr_factor``
  (default W, as ``strategy="horovod"``). For SGD with momentum this equals the mean of the local deltas.
- One worker is plain training (``hvd.DistributedOptimizer`` returns the unwrapped optimizer at size 1).
- A world that changes between epochs (``num_workers=[4, 2, 4]``, one size per epoch) continues from the
  same parameters, as an elastic job resumed from its last checkpoint: new worker ``r`` takes old worker
  ``r mod W_old``'s optimizer, scheduler and buffers, the shards follow the new W, and ``lr_factor`` stays.

Data order matches a real ``horovodrun`` job under :class:`~adasum_lightning.HorovodAdasumStrategy`:
worker ``w`` reads ``DistributedSampler(train_dataset, num_replicas=W, rank=w, shuffle=shuffle,
seed=sampler_seed)`` with ``set_epoch(epoch)``, batches of ``batch_size``, last partial batch kept —
the sampler Lightning inserts, whose seed is ``PL_GLOBAL_SEED`` (the ``seed_everything`` value).

Supported LightningModules (automatic optimisation):

- ``training_step(batch, batch_idx)`` returns the loss (a scalar tensor) or a dict with ``"loss"``;
  it must not use ``self.trainer`` (there is none; ``self.log`` calls are ignored);
- ``configure_optimizers`` returns one optimizer, optionally with LR schedulers in any form Lightning
  accepts (``interval`` ``"step"`` or ``"epoch"``, ``frequency``); ``ReduceLROnPlateau`` is not
  supported. It is called once per worker, so every worker gets its own optimizer and schedulers; it
  must not read ``self.trainer`` either (e.g. ``estimated_stepping_batches``: pass a schedule's length
  in steps explicitly, see :func:`steps_per_epoch`);
- parameters and batches on the CPU, any floating dtype (the Adasum arithmetic is float64 inside);
- one backward per step (no gradient accumulation); gradient clipping, AMP and manual optimisation
  are not simulated;
- buffers (e.g. BatchNorm running statistics) are not reduced. ``"adasum"``: each worker keeps its
  own, as Horovod ranks do, and evaluation uses worker 0's; ``"average"``: one set, updated by every
  worker's batch in turn;
- dropout and other randomness draw from the one global torch generator, worker after worker, so a
  model with dropout is statistically, not bitwise, like a real job.

Compute per epoch ≈ one single-process epoch (every sample is processed once); memory: one model, W
optimizer states (``adasum``), plus W parameter deltas during a step.

Measured against real ``horovodrun`` jobs (``tests/test_simulate.py``, ``docs/benchmarks.md``).
"""

from __future__ import annotations

import copy
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
import torchmetrics
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from tqdm.auto import tqdm

from adasum_lightning.learning_rate import scale_learning_rates
from adasum_lightning.reference import adasum_reduce, is_power_of_two

# Lightning's own reading of configure_optimizers' output, through the package's guarded private APIs.
from adasum_lightning.trainer._compat import configure_optimizers, configure_schedulers

__all__ = ["simulate", "evaluate_classifier", "SimulationResult", "steps_per_epoch"]


@dataclass
class SimulationResult:
    """What :func:`simulate` measured.

    Attributes:
        method: ``"adasum"`` or ``"average"``.
        num_workers: simulated world size W (of the first epoch when it changes).
        lr_factor: the factor applied to every learning rate.
        batch_size: per-worker batch (the global batch is ``W × batch_size``).
        steps_per_epoch: optimizer steps per epoch (``ceil(ceil(len(train)/W) / batch_size)``; of the
            first epoch when W changes).
        history: one dict per evaluated epoch: ``epoch`` (1-based, completed epochs), ``num_workers``
            (W of that epoch), ``step`` (optimizer steps so far), ``train_loss`` (mean over the epoch's
            worker batches), ``wall_s`` (seconds since the start) and the entries of ``eval_fn`` (by
            default ``val_acc`` as a fraction in [0, 1] and ``val_loss``, mean cross-entropy in nats).
        target: the accuracy target, or None.
        epochs_to_target / steps_to_target: first epoch (and step count) whose ``val_acc`` ≥ target;
            None when not reached within ``max_epochs`` (or when no target/validation set was given).
        diverged: the mean training loss of an epoch was not finite (NaN/inf); the run stopped there.
    """

    method: str
    num_workers: int
    lr_factor: float
    batch_size: int
    steps_per_epoch: int
    history: list[dict[str, float]] = field(default_factory=list)
    target: float | None = None
    epochs_to_target: int | None = None
    steps_to_target: int | None = None
    diverged: bool = False


def steps_per_epoch(num_samples: int, num_workers: int, batch_size: int) -> int:
    """Optimizer steps per epoch of a ``DistributedSampler`` shard (padded, ``drop_last=False``) read in
    batches of ``batch_size`` with the last partial batch kept: ``ceil(ceil(n / W) / B)``."""
    return math.ceil(math.ceil(num_samples / num_workers) / batch_size)


@torch.no_grad()
def evaluate_classifier(
    module: torch.nn.Module, dataset: Dataset, batch_size: int = 1000
) -> dict[str, float]:
    """Accuracy and loss of a classifier over ``dataset`` (the default ``eval_fn`` of :func:`simulate`).

    Args:
        module: maps a batch ``x`` to scores of shape ``(B, C)`` (logits or log-probabilities).
        dataset: yields ``(x, y)`` with ``y`` an int64 class index.
        batch_size: evaluation batch.

    Returns:
        ``{"val_acc": fraction in [0, 1], "val_loss": mean cross-entropy in nats}`` (cross-entropy of
        log-probabilities equals their negative log-likelihood, so both kinds of output work).
    """
    was_training = module.training
    module.eval()
    accuracy = None
    loss_sum, count = 0.0, 0
    for x, y in DataLoader(dataset, batch_size=batch_size):
        scores = module(x)
        if accuracy is None:
            accuracy = torchmetrics.classification.MulticlassAccuracy(
                num_classes=scores.shape[1], average="micro"
            )
        accuracy.update(scores, y)
        loss_sum += F.cross_entropy(scores, y, reduction="sum").item()
        count += len(y)
    module.train(was_training)
    return {"val_acc": float(accuracy.compute()), "val_loss": loss_sum / count}


class _Worker:
    """One simulated rank: its data shard, its optimizer (own state), its schedulers, its buffers."""

    def __init__(self, module: pl.LightningModule, lr_factor: float) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optimizers, schedulers, monitor = configure_optimizers(module.configure_optimizers())
        if len(optimizers) != 1:
            raise ValueError(f"simulate supports one optimizer, configure_optimizers gave {len(optimizers)}")
        self.configs = configure_schedulers(schedulers, monitor)
        for config in self.configs:
            if config.reduce_on_plateau:
                raise ValueError("simulate does not support ReduceLROnPlateau schedulers")
        self.optimizer = optimizers[0]
        scale_learning_rates([self.optimizer], [c.scheduler for c in self.configs], lr_factor)
        self.buffers = {name: b.detach().clone() for name, b in module.named_buffers()}

    def step_schedulers(self, interval: str, count: int) -> None:
        for config in self.configs:
            if config.interval == interval and count % config.frequency == 0:
                config.scheduler.step()


def _loss_of(output: Any) -> torch.Tensor:
    loss = output["loss"] if isinstance(output, dict) else output
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError("training_step must return a scalar loss tensor or a dict with 'loss'")
    return loss


def simulate(
    module: pl.LightningModule,
    train_dataset: Dataset,
    *,
    num_workers: int | Sequence[int],
    batch_size: int,
    method: Literal["adasum", "average"] = "adasum",
    max_epochs: int = 1,
    max_steps: int | None = None,
    lr_factor: float | None = None,
    sampler_seed: int = 0,
    shuffle: bool = True,
    val_dataset: Dataset | None = None,
    eval_fn: Callable[[pl.LightningModule, Dataset], dict[str, float]] | None = None,
    target: float | None = None,
    stop_at_target: bool = True,
    progress: bool = True,
) -> SimulationResult:
    """Train ``module`` in place as ``num_workers`` Horovod workers would (see the module docstring).

    Args:
        module: the LightningModule (its current parameters are the common start, i.e. rank 0's).
        train_dataset: the full training set; each worker reads its ``DistributedSampler`` shard.
        num_workers: simulated world size W ≥ 1 (a power of 2 for ``"adasum"``, as Horovod's CPU Adasum),
            or one W per epoch (``max_epochs`` of them): the world changes between epochs (module docstring).
        batch_size: per-worker batch.
        method: ``"adasum"`` (deltas combined by Adasum) or ``"average"`` (gradients averaged).
        max_epochs: epochs to run at most.
        max_steps: optimizer steps to run at most (None: no limit).
        lr_factor: learning-rate factor; default 1 for ``"adasum"``, W (the first epoch's) for ``"average"``.
        sampler_seed: the ``DistributedSampler`` seed (Lightning uses the ``seed_everything`` value).
        shuffle: shuffle the shards each epoch (``set_epoch``), as Lightning does for a shuffling loader.
        val_dataset: evaluated after every epoch with ``eval_fn`` (none when None).
        eval_fn: ``(module, val_dataset) -> dict`` of metrics; default :func:`evaluate_classifier`.
        target: stop (if ``stop_at_target``) and record the epoch when ``val_acc`` ≥ target. A run also
            stops after an epoch whose mean training loss is not finite (``result.diverged``).
        stop_at_target: stop early once the target is reached.
        progress: show a tqdm bar over optimizer steps.

    Returns:
        a :class:`SimulationResult`; ``module`` holds the final parameters.

    Raises:
        ValueError: unknown ``method``; W < 1, or W not a power of 2 with ``"adasum"``; a list of W whose
            length is not ``max_epochs``; a module outside the supported set (several optimizers,
            ReduceLROnPlateau, a non-scalar loss).
    """
    if method not in ("adasum", "average"):
        raise ValueError(f"method must be 'adasum' or 'average', got {method!r}")
    sizes = list(num_workers) if isinstance(num_workers, Sequence) else [num_workers] * max_epochs
    if len(sizes) != max_epochs:
        raise ValueError(
            f"num_workers gives {len(sizes)} world sizes for max_epochs={max_epochs}: give one per epoch"
        )
    for size in sizes:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"num_workers must be a positive int, got {size!r}")
        if method == "adasum" and not is_power_of_two(size):
            raise ValueError(f"Adasum needs a power-of-2 number of workers (as Horovod on CPU), got {size}")
    if lr_factor is None:
        lr_factor = 1.0 if method == "adasum" else float(sizes[0])
    eval_fn = eval_fn or evaluate_classifier

    module.train()
    params = [p for p in module.parameters() if p.requires_grad]
    workers: list[_Worker] = []
    world = 0
    per_epoch = [steps_per_epoch(len(train_dataset), w, batch_size) for w in sizes]
    result = SimulationResult(method, sizes[0], float(lr_factor), batch_size, per_epoch[0], target=target)
    total = sum(per_epoch) if max_steps is None else min(max_steps, sum(per_epoch))
    desc = f"simulate {method} W={'→'.join(str(w) for w in dict.fromkeys(sizes))}"
    bar = tqdm(total=total, disable=not progress, leave=False, desc=desc, unit="step")
    start_time = time.perf_counter()
    step = 0
    with warnings.catch_warnings():
        # training_step's self.log() without a Trainer only warns.
        warnings.filterwarnings("ignore", message=".*self.trainer` reference is not registered.*")
        for epoch in range(max_epochs):
            if sizes[epoch] != world:
                world = sizes[epoch]
                # Like hvd.DistributedOptimizer, one Adasum worker is plain training (no delta arithmetic).
                use_deltas = method == "adasum" and world > 1
                with_state = world if use_deltas else 1
                if not workers:
                    workers = [_Worker(module, lr_factor) for _ in range(with_state)]
                elif len(workers) != with_state:  # new worker r resumes old worker r mod W_old's state
                    workers = [
                        _resumed(module, lr_factor, workers[r % len(workers)]) for r in range(with_state)
                    ]
                samplers = [
                    DistributedSampler(
                        train_dataset, num_replicas=world, rank=w, shuffle=shuffle, seed=sampler_seed
                    )
                    for w in range(world)
                ]
                loaders = [DataLoader(train_dataset, batch_size=batch_size, sampler=s) for s in samplers]
            for sampler in samplers:
                sampler.set_epoch(epoch)
            loss_sum, loss_count = 0.0, 0
            for batch_idx, batches in enumerate(zip(*loaders, strict=True)):
                start = [p.detach().clone() for p in params]
                if use_deltas:
                    deltas: list[list[torch.Tensor]] = []
                    for worker, batch in zip(workers, batches, strict=True):
                        _load_buffers(module, worker.buffers)
                        worker.optimizer.zero_grad()
                        loss = _loss_of(module.training_step(batch, batch_idx))
                        loss.backward()
                        worker.optimizer.step()
                        deltas.append([p.detach() - s for p, s in zip(params, start, strict=True)])
                        worker.buffers = _save_buffers(module)
                        with torch.no_grad():
                            for p, s in zip(params, start, strict=True):
                                p.copy_(s)
                        loss_sum += loss.item()
                    with torch.no_grad():
                        for i, p in enumerate(params):
                            p.copy_(start[i] + adasum_reduce([d[i] for d in deltas]))
                    _load_buffers(module, workers[0].buffers)
                else:
                    worker = workers[0]
                    per_worker: list[list[torch.Tensor]] = []
                    for batch in batches:
                        worker.optimizer.zero_grad()
                        loss = _loss_of(module.training_step(batch, batch_idx))
                        loss.backward()
                        per_worker.append(
                            [
                                torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
                                for p in params
                            ]
                        )
                        loss_sum += loss.item()
                    for i, p in enumerate(params):
                        p.grad = _pairwise_sum([g[i] for g in per_worker]).div_(world)
                    worker.optimizer.step()
                loss_count += len(batches)
                step += 1
                for worker in workers:
                    worker.step_schedulers("step", step)
                bar.update(1)
                if max_steps is not None and step >= max_steps:
                    break
            for worker in workers:
                worker.step_schedulers("epoch", epoch + 1)
            record = {
                "epoch": epoch + 1,
                "num_workers": world,
                "step": step,
                "train_loss": loss_sum / max(loss_count, 1),
            }
            if val_dataset is not None:
                record.update(eval_fn(module, val_dataset))
            record["wall_s"] = time.perf_counter() - start_time
            result.history.append(record)
            bar.set_postfix({k: round(v, 4) for k, v in record.items() if k.startswith("val")})
            if not math.isfinite(record["train_loss"]):
                result.diverged = True
                break
            reached = target is not None and record.get("val_acc", -math.inf) >= target
            if reached and result.epochs_to_target is None:
                result.epochs_to_target, result.steps_to_target = epoch + 1, step
                if stop_at_target:
                    break
            if max_steps is not None and step >= max_steps:
                break
    bar.close()
    return result


def _resumed(module: pl.LightningModule, lr_factor: float, old: _Worker) -> _Worker:
    """A new worker with ``old``'s optimizer, scheduler and buffer state (a rank resumed from its file)."""
    worker = _Worker(module, lr_factor)
    worker.optimizer.load_state_dict(copy.deepcopy(old.optimizer.state_dict()))
    for mine, theirs in zip(worker.configs, old.configs, strict=True):
        mine.scheduler.load_state_dict(copy.deepcopy(theirs.scheduler.state_dict()))
    worker.buffers = {name: b.clone() for name, b in old.buffers.items()}
    return worker


def _pairwise_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Sum neighbours first, ``(g0 + g1) + (g2 + g3)``, the order of a recursive-doubling allreduce."""
    while len(tensors) > 1:
        pairs = [tensors[i] + tensors[i + 1] for i in range(0, len(tensors) - 1, 2)]
        tensors = pairs + ([tensors[-1]] if len(tensors) % 2 else [])
    return tensors[0].clone()


def _save_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in module.named_buffers()}


@torch.no_grad()
def _load_buffers(module: torch.nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    if buffers:
        own = dict(module.named_buffers())
        for name, value in buffers.items():
            own[name].copy_(value)
