"""Local SGD / DiLoCo study: the workers' pseudo-gradients combined by Adasum or by averaging.

N workers simulated in one process; ``python -m benchmarks.local_sgd [--quick]`` runs the study of
docs/local_sgd.md.

One outer round (DiLoCo: Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
Models", arXiv:2311.08105; local SGD: Lin et al., "Don't Use Large Mini-Batches, Use Local SGD",
arXiv:1808.07217):

1. every worker ``w`` starts from ``θ_sync`` and takes ``H = sync_every`` steps of its own inner optimizer
   (its state kept across rounds) on batches of its own shard;
2. pseudo-gradient ``Δ_w = θ_w − θ_sync`` per worker and parameter tensor;
3. ``Δ = adasum_reduce([Δ_0, …, Δ_{N−1}])`` per tensor (:func:`adasum_lightning.reference.adasum_reduce`, the
   pairing order of the distributed allreduce) for ``combine="adasum"``, or ``Δ = mean_w Δ_w`` for
   ``combine="mean"`` (torchft's DiLoCo rule);
4. ``θ_sync ← θ_sync + Δ`` without an outer optimizer, or one step of the outer optimizer on ``θ_sync``
   with ``−Δ`` as its gradient (DiLoCo: Nesterov SGD, lr 0.7, momentum 0.9);
5. every worker continues from the new ``θ_sync`` (its inner-optimizer state is kept).

``overlap=True`` is ``overlap_sync=True`` (docs/local_sgd.md): the combined ``Δ`` of a round is applied at the
end of the next round, and each worker continues from the newest ``θ_sync`` plus its own ``Δ_w`` meanwhile;
the last round's ``Δ`` is applied at the end (the flush). ``compression="bf16"`` / ``"fp16"`` rounds what the
combine sends to that dtype (:func:`combine_deltas`).

The N workers run as one batched computation: each parameter is stacked along a leading worker dimension
(``(N, *shape)``) and the model is applied per worker with ``torch.func.vmap`` over
``torch.func.functional_call``; the loss summed over workers gives each worker's slice its own gradient.
One inner optimizer over the stacked tensors then equals N separate ones, which holds for element-wise
optimizers (SGD with or without momentum, Adam, AdamW) and not for those that mix elements of a tensor
(LAMB, LARS, gradient-norm clipping). Models must have no buffers that change in training (no BatchNorm);
dropout draws its own masks per worker (``vmap(randomness="different")``).

Bytes (:func:`bytes_per_round`): what one rank sends in one round's allreduce of all parameters as one
float32 bucket: for ``"mean"`` the ring allreduce's ``2 (N−1)/N · B`` (reduce-scatter then all-gather,
``B`` the parameter bytes); for ``"adasum"`` the messages of
:func:`adasum_lightning.allreduce.adasum_allreduce`, counted by :func:`adasum_allreduce_bytes`.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

from adasum_lightning.allreduce import TREE_MAX_BYTES
from adasum_lightning.reference import adasum_reduce
from examples.mnist_torch import MNISTCNN

ROOT = Path(__file__).resolve().parents[1]
COMBINES = ("adasum", "mean")
#: The wire dtypes of ``compression`` (``"none"``: float32).
WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# ---------------------------------------------------------------------------------------------------------
# Bytes sent per rank


def ring_allreduce_bytes(num_bytes: int, world_size: int) -> float:
    """Bytes one rank sends in a ring allreduce of ``num_bytes``: ``2 (N−1)/N · num_bytes``.

    Reduce-scatter (N−1 sends of a 1/N chunk) then all-gather (N−1 more); the bandwidth-optimal count,
    what NCCL's and Gloo's ring algorithms send (chunks of unequal length move the per-rank count by a few
    elements, ignored here). 0 for one rank.
    """
    return 2.0 * (world_size - 1) / world_size * num_bytes


def adasum_allreduce_bytes(counts: Sequence[int], elem_size: int, world_size: int) -> list[int]:
    """Bytes each rank sends in :func:`adasum_lightning.allreduce.adasum_allreduce` of one bucket.

    The message pattern of ``adasum_lightning/allreduce.py``'s ``_reduce_flat``: with ``P`` the largest
    power of 2 ≤ N, ranks ``r ≥ P`` send their bucket to ``r − P`` and get the result back; then, for
    buckets with ``bytes × log2 P ≤ TREE_MAX_BYTES`` (8 MB), a binomial tree (each rank ``r > 0`` sends its
    bucket once up, rank ``q`` sends the result down once per level below its lowest set bit: rank 0
    ``log2 P`` times); for larger ones vector halving / distance doubling (at each level a half of the
    current segment, plus the ``(tensors, 3)`` float64 dot products and norms summed over ``2d`` ranks by
    ``log2(2d)`` pairwise swaps), then distance halving (the kept segments back).

    Args:
        counts: elements of each tensor in the bucket.
        elem_size: bytes per element (4 for float32).
        world_size: N ≥ 1.

    Returns:
        Bytes sent by each rank ``0 … N−1``.
    """
    total = sum(counts) * elem_size
    sent = [0] * world_size
    if world_size == 1 or total == 0:
        return sent
    p = 1 << (world_size.bit_length() - 1)
    levels = p.bit_length() - 1
    for r in range(p, world_size):  # fold in, result back
        sent[r] += total
        sent[r - p] += total
    if total * levels <= TREE_MAX_BYTES:
        for r in range(1, p):
            sent[r] += total  # up the tree, once
        for r in range(p):
            low = r & -r if r else p  # lowest set bit (rank 0: all levels)
            sent[r] += total * (low.bit_length() - 1)  # down: one send per level d < low
        return sent
    stats = 24 * len(counts)  # (tensors, 3) float64
    for r in range(p):
        n = sum(counts)
        d = 1
        while d < p:
            half = n >> 1
            left = (r & d) == 0
            give, keep = (n - half, half) if left else (half, n - half)
            sent[r] += give * elem_size + stats * ((2 * d).bit_length() - 1)  # the half, log2(2d) swaps
            sent[r] += keep * elem_size  # sent back in the distance halving
            n = keep
            d <<= 1
    return sent


def bytes_per_round(
    model: nn.Module, world_size: int, combine: str, compression: str = "none"
) -> dict[str, float]:
    """Bytes one rank sends per outer round: ``mean_per_rank`` (over ranks) and ``max_per_rank``, for the
    model's parameters as one bucket of the wire dtype (float32, or ``compression``'s); ``param_bytes`` is
    that bucket's size."""
    counts = [p.numel() for p in model.parameters()]
    elem = next(model.parameters()).element_size() if compression == "none" else 2
    b = sum(counts) * elem
    if combine == "mean":
        ring = ring_allreduce_bytes(b, world_size)
        return {"param_bytes": b, "mean_per_rank": ring, "max_per_rank": ring, "algorithm": "ring"}
    sent = adasum_allreduce_bytes(counts, elem, world_size)
    p = 1 << (world_size.bit_length() - 1)
    algo = "tree" if b * (p.bit_length() - 1) <= TREE_MAX_BYTES else "halving"
    return {"param_bytes": b, "mean_per_rank": sum(sent) / world_size, "max_per_rank": max(sent),
            "algorithm": algo}  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# The simulator


def combine_deltas(deltas: Sequence[torch.Tensor], combine: str, compression: str = "none") -> torch.Tensor:
    """The workers' pseudo-gradients of one parameter tensor (N float32 tensors, one shape) combined: their
    Adasum in the allreduce's pairing order, or their mean; float32.

    With ``compression`` ``"bf16"`` / ``"fp16"`` every sent piece is rounded to that dtype: Adasum of the
    rounded deltas, each level computed in float64 and rounded once; the mean of the rounded deltas summed
    in float32 in rank order, divided by N and rounded once.
    """
    if combine not in COMBINES:
        raise ValueError(f"combine must be one of {COMBINES}, got {combine!r}")
    if compression == "none":
        return adasum_reduce(deltas) if combine == "adasum" else torch.stack(list(deltas)).mean(0)
    wire = WIRE_DTYPES[compression]
    if combine == "adasum":
        return adasum_reduce([d.to(wire) for d in deltas]).float()
    total = deltas[0].to(wire).float()
    for d in deltas[1:]:
        total = total + d.to(wire).float()
    return (total / len(deltas)).to(wire).float()


def outer_update(
    theta: list[torch.Tensor], combined: list[torch.Tensor], outer: torch.optim.Optimizer | None
) -> None:
    """``θ_sync ← U(θ_sync, Δ)`` in place: ``θ_sync + Δ``, or one outer-optimizer step with ``−Δ`` as the
    gradient."""
    if outer is None:
        for t, d in zip(theta, combined, strict=True):
            t.add_(d)
        return
    for t, d in zip(theta, combined, strict=True):
        t.grad = -d
    outer.step()
    outer.zero_grad(set_to_none=True)


def simulate_diloco(
    model_fn: Callable[[], nn.Module],
    shards: Sequence[Callable[[int], tuple[torch.Tensor, torch.Tensor]]],
    *,
    sync_every: int,
    combine: str,
    inner_optimizer_fn: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    outer_optimizer_fn: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None,
    rounds: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
    eval_fn: Callable[[nn.Module], float] | None = None,
    eval_every: int = 1,
    diverge_factor: float = 2.0,
    overlap: bool = False,
    compression: str = "none",
) -> dict[str, Any]:
    """Run ``rounds`` outer rounds of DiLoCo / local SGD with ``N = len(shards)`` simulated workers.

    Args:
        model_fn: builds the model; its parameters are the initial ``θ_sync`` of every worker.
        shards: one per worker: ``shard(step) -> (inputs, targets)``, the batch of the worker's inner step
            ``step`` (0, 1, …), deterministic, same shapes for every worker and step.
        sync_every: H, inner steps per round.
        combine: ``"adasum"`` or ``"mean"`` (:func:`combine_deltas`, per parameter tensor).
        inner_optimizer_fn: builds the workers' inner optimizer from the stacked ``(N, *shape)`` parameter
            tensors; must be element-wise (module docstring).
        outer_optimizer_fn: builds the outer optimizer from the ``θ_sync`` tensors (stepped with ``−Δ`` as
            gradient), or ``None``: ``θ_sync += Δ``.
        rounds: outer rounds.
        loss_fn: ``loss_fn(model(inputs), targets)``, a scalar per worker.
        eval_fn: ``eval_fn(model)`` with ``θ_sync`` loaded, e.g. a validation loss; called before the first
            round and after every ``eval_every`` rounds and the last. With ``overlap`` it sees the flushed
            ``θ_sync`` (the pending ``Δ`` applied to a copy): what a run ending at that round hands out.
        diverge_factor: the run stops early (``diverged``) once an evaluation is not finite or exceeds
            ``diverge_factor`` × the initial one.
        overlap: each round's combined ``Δ`` applied one round late (``overlap_sync``, module docstring).
        compression: ``"none"``, ``"bf16"`` or ``"fp16"``: the combine's wire dtype (:func:`combine_deltas`).

    Returns:
        ``history`` ([round, eval] pairs), ``final`` (the last evaluation), ``diverged``, ``model`` (with
        ``θ_sync`` loaded), ``worker_steps``, ``wall_s``, ``cpu_s``.
    """
    start_wall, start_cpu = time.perf_counter(), time.process_time()
    model = model_fn()
    n = len(shards)
    names = [k for k, _ in model.named_parameters()]
    theta = [p.detach().clone() for p in model.parameters()]
    stacked = [t.unsqueeze(0).repeat(n, *([1] * t.dim())).requires_grad_() for t in theta]
    start = [s.detach().clone() for s in stacked]  # each worker's window start
    pending: list[torch.Tensor] | None = None  # overlap: the combined Δ not yet applied
    inner = inner_optimizer_fn(stacked)
    outer = outer_optimizer_fn(theta) if outer_optimizer_fn is not None else None

    def worker_loss(params: tuple[torch.Tensor, ...], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss_fn(functional_call(model, dict(zip(names, params, strict=True)), (x,)), y)

    batched_loss = vmap(worker_loss, randomness="different")

    def evaluate() -> float:
        params = theta
        if pending is not None:  # the flush, on a copy
            ghost, params = copy.deepcopy((outer, theta))
            outer_update(params, pending, ghost)
        with torch.no_grad():
            for p, t in zip(model.parameters(), params, strict=True):
                p.copy_(t)
        return float(eval_fn(model))

    history: list[list[float]] = []
    diverged = False
    if eval_fn is not None:
        history.append([0, evaluate()])
    step = 0
    for r in range(1, rounds + 1):
        for _ in range(sync_every):
            batches = [shard(step) for shard in shards]
            xs = torch.stack([b[0] for b in batches])
            ys = torch.stack([b[1] for b in batches])
            inner.zero_grad(set_to_none=True)
            batched_loss(tuple(stacked), xs, ys).sum().backward()
            inner.step()
            step += 1
        with torch.no_grad():
            deltas = [s.detach() - w for s, w in zip(stacked, start, strict=True)]
            combined = [combine_deltas(list(d), combine, compression) for d in deltas]
            if pending is not None:
                outer_update(theta, pending, outer)
            if overlap:  # this round's Δ waits; each worker goes on from θ_sync + its own Δ_w
                pending = combined
                for s, t, d in zip(stacked, theta, deltas, strict=True):
                    s.copy_(t + d)
            else:
                outer_update(theta, combined, outer)
                for s, t in zip(stacked, theta, strict=True):
                    s.copy_(t.unsqueeze(0).expand_as(s))
            for s, w in zip(stacked, start, strict=True):
                w.copy_(s)
        if eval_fn is not None and (r % eval_every == 0 or r == rounds):
            value = evaluate()
            history.append([r, value])
            if not math.isfinite(value) or value > diverge_factor * history[0][1]:
                diverged = True
                break
    if eval_fn is None:
        evaluate_final = None
    else:
        evaluate_final = history[-1][1]
    with torch.no_grad():
        if pending is not None:  # the flush
            outer_update(theta, pending, outer)
        for p, t in zip(model.parameters(), theta, strict=True):
            p.copy_(t)
    return {
        "history": history,
        "final": evaluate_final,
        "diverged": diverged,
        "model": model,
        "worker_steps": step * n,
        "wall_s": time.perf_counter() - start_wall,
        "cpu_s": time.process_time() - start_cpu,
    }


# ---------------------------------------------------------------------------------------------------------
# Models and data


def mnist_mlp() -> nn.Module:
    """The MNIST MLP 784-128-10 (ReLU; 101,770 float32 parameters); input ``(B, 784)``, logits ``(B, 10)``."""
    return nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))


class CharLM(nn.Module):
    """A byte-level causal transformer language model: vocabulary 256, learned positions, pre-LayerNorm
    blocks of causal self-attention and a 4×-wide GELU MLP, an untied output layer.

    Input ``(B, T)`` int64 bytes, ``T ≤ context``; output ``(B, T, 256)`` logits for the next byte. Attention
    is written out (no fused kernel) so that it runs under ``vmap``. Defaults: d_model 64, 2 layers, 4 heads,
    context 64 (≈ 0.13 M parameters).
    """

    def __init__(self, d_model: int = 64, layers: int = 2, heads: int = 4, context: int = 64) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(256, d_model)
        self.pos = nn.Parameter(torch.randn(context, d_model) * 0.02)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "ln1": nn.LayerNorm(d_model),
                    "qkv": nn.Linear(d_model, 3 * d_model),
                    "proj": nn.Linear(d_model, d_model),
                    "ln2": nn.LayerNorm(d_model),
                    "up": nn.Linear(d_model, 4 * d_model),
                    "down": nn.Linear(4 * d_model, d_model),
                }
            )
            for _ in range(layers)
        )
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape
        h = self.embed(x) + self.pos[:t]
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln1"](h)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
            att = att.masked_fill(mask, float("-inf")).softmax(-1)
            h = h + blk["proj"]((att @ v).transpose(1, 2).reshape(b, t, -1))
            h = h + blk["down"](F.gelu(blk["up"](blk["ln2"](h))))
        return self.head(self.ln(h))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy in nats per byte: logits ``(B, T, 256)``, targets ``(B, T)`` int64."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class TensorShard:
    """One worker's part of a tensor data set: ``shard(step)`` is batch ``step`` of a fresh random order
    per epoch (the order a function of ``seed`` and the epoch only).

    Args:
        x, y: the worker's examples ``(n, …)`` and labels ``(n,)``.
        batch_size: examples per step (``n`` must be at least that).
        seed: the shuffling seed.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int) -> None:
        self.x, self.y, self.batch_size, self.seed = x, y, batch_size, seed
        self.per_epoch = len(x) // batch_size
        self._epoch, self._order = -1, torch.empty(0, dtype=torch.long)

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, i = divmod(step, self.per_epoch)
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._order = epoch, torch.randperm(len(self.x), generator=g)
        idx = self._order[i * self.batch_size : (i + 1) * self.batch_size]
        return self.x[idx], self.y[idx]


class TextShard:
    """One worker's slice of a byte string: ``shard(step)`` is ``batch_size`` windows at random offsets
    (a function of ``seed`` and ``step``): inputs ``(B, T)`` and next-byte targets ``(B, T)``, int64."""

    def __init__(self, data: torch.Tensor, context: int, batch_size: int, seed: int) -> None:
        self.data, self.context, self.batch_size, self.seed = data, context, batch_size, seed

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.data) - self.context - 1, (self.batch_size,), generator=g)
        idx = starts[:, None] + torch.arange(self.context + 1)
        w = self.data[idx].long()
        return w[:, :-1], w[:, 1:]


def mnist_tensors() -> dict[str, torch.Tensor]:
    """Real MNIST flattened: ``x_train (55000, 784)``, ``x_val (5000, 784)`` (the last 5,000 training
    images, held out), ``x_test (10000, 784)`` float32 normalised as the example does, labels int64."""
    from benchmarks.common import prepared_root, tensor_split

    root = prepared_root()
    train, test = tensor_split(root, train=True), tensor_split(root, train=False)
    x, y = train.tensors[0].flatten(1), train.tensors[1]
    return {"x_train": x[:55_000], "y_train": y[:55_000], "x_val": x[55_000:], "y_val": y[55_000:],
            "x_test": test.tensors[0].flatten(1), "y_test": test.tensors[1]}  # fmt: skip


def text_corpus(max_bytes: int) -> tuple[torch.Tensor, list[str]]:
    """The Python standard library's top-level ``*.py`` files (``os.path.dirname(os.__file__)``, sorted by
    name) concatenated, cut at ``max_bytes``: a uint8 tensor and the files used."""
    files = sorted(Path(os.path.dirname(os.__file__)).glob("*.py"))
    parts, used, size = [], [], 0
    for f in files:
        if size >= max_bytes:
            break
        parts.append(f.read_bytes())
        used.append(f.name)
        size += len(parts[-1])
    data = b"".join(parts)[:max_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8), used


# ---------------------------------------------------------------------------------------------------------
# The study

#: Inner optimizers per model: (class name, keyword arguments).
INNERS = {
    "mnist": {"adamw": ("AdamW", {"lr": 1e-3}), "sgdm": ("SGD", {"lr": 0.05, "momentum": 0.9})},
    "lm": {
        "adamw": ("AdamW", {"lr": 3e-3, "betas": (0.9, 0.95)}),
        "sgdm": ("SGD", {"lr": 0.2, "momentum": 0.9}),
    },
}
INNERS["cnn"] = INNERS["mnist"]  # the example's CNN trains with the MLP's inner optimizers
#: The compared methods: (combine, outer optimizer?); the outer one is Nesterov SGD, momentum 0.9.
METHODS = {
    "adasum_nesterov": ("adasum", True),
    "mean_nesterov": ("mean", True),
    "adasum_direct": ("adasum", False),
    "mean_direct": ("mean", False),
}


#: The forms of the overlap / wire study: (``overlap``, ``compression``).
FORMS = {
    "plain": (False, "none"),
    "bf16": (False, "bf16"),
    "overlap": (True, "none"),
    "overlap_bf16": (True, "bf16"),
}


def methods_for(mc: dict, inner: str) -> list[str]:
    """The methods a model's config runs with inner optimizer ``inner``: ``methods`` plus
    ``extra_methods[inner]``."""
    return list(mc["methods"]) + list(mc.get("extra_methods", {}).get(inner, []))


#: ``make bench``-sized study (≈ 2.3 CPU-hours on one thread, the CNN ≈ 1.8 of them; docs/local_sgd.md says
#: what was shrunk).
FULL: dict[str, Any] = {
    "models": ["mnist", "cnn", "lm"],
    "mnist": {
        "sizes": [4, 8, 16],
        "sync_every": [1, 10, 50],
        "rounds": {"1": 100, "10": 30, "50": 15},
        "eval_every": {"1": 5, "10": 1, "50": 1},
        "batch_size": 32,
        "inners": ["adamw", "sgdm"],
        "seeds": [1, 2, 3],
        "search_seed": 0,
        "search_size": 8,
        "outer_lrs": [0.1, 0.175, 0.35, 0.7, 1.0],
        "extend_low": 2,
        "methods": ["adasum_nesterov", "mean_nesterov", "adasum_direct"],
        "extra_methods": {"adamw": ["mean_direct"]},
        "aim_check": {
            "inner": "adamw",
            "N": 16,
            "H": 50,
            "method": "adasum_nesterov",
            "outer_lrs": [0.1, 0.35],
        },
        # overlap_sync and a 16-bit wire, each method at its searched best outer lr
        "forms": {
            "inners": ["adamw", "sgdm"],
            "sizes": [8, 16],
            "sync_every": [10, 50],
            "methods": ["adasum_nesterov", "mean_nesterov"],
            "forms": ["bf16", "overlap", "overlap_bf16"],
        },
    },
    "lm": {
        "sizes": [4, 8, 16],
        "sync_every": [1, 10, 50],
        "rounds": {"1": 30, "10": 12, "50": 15},
        "eval_every": {"1": 3, "10": 1, "50": 1},
        "batch_size": 4,
        "context": 64,
        "corpus_bytes": 2_000_000,
        "val_windows": 64,
        "inners": ["adamw", "sgdm"],
        "seeds": [1, 2, 3],
        "search_seed": 0,
        "search_size": 8,
        "outer_lrs": [0.175, 0.35, 0.7],
        "extend_low": 2,
        "methods": ["adasum_nesterov", "mean_nesterov", "adasum_direct"],
    },
}

#: The example's CNN: the MLP's grid, with an outer-lr grid of 3 values and without the MLP's extra runs;
#: overlap and the wire in one cell.
FULL["cnn"] = {
    **{k: v for k, v in FULL["mnist"].items() if k not in ("extra_methods", "aim_check", "forms")},
    "outer_lrs": [0.1, 0.35, 0.7],
    "forms": {**FULL["mnist"]["forms"], "inners": ["adamw"], "sizes": [8], "sync_every": [10]},
}

#: ``--quick``: the same pipeline in about a minute.
QUICK: dict[str, Any] = {
    "models": ["mnist", "lm"],
    "mnist": {**FULL["mnist"], "sizes": [4], "sync_every": [1, 10], "rounds": {"1": 10, "10": 4},
              "eval_every": {"1": 2, "10": 1}, "inners": ["adamw"], "seeds": [1], "search_size": 4,
              "outer_lrs": [0.35, 0.7], "extend_low": 0,
              "aim_check": {"inner": "adamw", "N": 4, "H": 10, "method": "adasum_nesterov",
                            "outer_lrs": [0.35]},
              "forms": {**FULL["mnist"]["forms"], "inners": ["adamw"], "sizes": [4], "sync_every": [10]}},
    "lm": {**FULL["lm"], "sizes": [4], "sync_every": [10], "rounds": {"10": 3}, "eval_every": {"10": 1},
           "inners": ["adamw"], "seeds": [1], "search_size": 4, "outer_lrs": [0.7], "extend_low": 0,
           "corpus_bytes": 300_000, "val_windows": 16},
}  # fmt: skip


class Task:
    """One model's data, shards, loss and evaluation for the study."""

    def __init__(self, model: str, cfg: dict) -> None:
        self.name, self.cfg = model, cfg
        if model == "mnist":
            self.data = mnist_tensors()
            self.model_fn = mnist_mlp
            self.loss_fn = F.cross_entropy
        elif model == "cnn":
            images = mnist_tensors()
            self.data = {k: v.view(-1, 1, 28, 28) if k.startswith("x_") else v for k, v in images.items()}
            self.model_fn = MNISTCNN
            self.loss_fn = F.nll_loss
        elif model == "lm":
            data, self.files = text_corpus(cfg["corpus_bytes"])
            cut = int(len(data) * 0.9)
            self.train, self.val = data[:cut], data[cut:]
            ctx = cfg["context"]
            starts = torch.linspace(0, len(self.val) - ctx - 2, cfg["val_windows"]).long()
            w = self.val[starts[:, None] + torch.arange(ctx + 1)].long()
            self.val_x, self.val_y = w[:, :-1], w[:, 1:]
            self.model_fn = lambda: CharLM(context=ctx)
            self.loss_fn = lm_loss
        else:
            raise ValueError(f"unknown model {model!r}")

    def shards(self, n: int, seed: int) -> list:
        """N iid shards (MNIST: a random partition of the 55,000 training images) or contiguous slices
        (text: worker ``w`` reads the ``w``-th 1/N of the training bytes)."""
        b = self.cfg["batch_size"]
        if self.name in ("mnist", "cnn"):
            x, y = self.data["x_train"], self.data["y_train"]
            perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
            parts = perm.chunk(n)
            return [TensorShard(x[p], y[p], b, seed * 100 + w) for w, p in enumerate(parts)]
        size = len(self.train) // n
        ctx = self.cfg["context"]
        return [TextShard(self.train[w * size : (w + 1) * size], ctx, b, seed * 100 + w) for w in range(n)]

    def evaluate(self, model: nn.Module, split: str = "val") -> float:
        """Mean loss of ``model`` on the validation (or MNIST test) split, dropout off."""
        training = model.training
        model.eval()
        try:
            with torch.no_grad():
                if self.name == "lm":
                    return lm_loss(model(self.val_x), self.val_y).item()
                x, y = self.data[f"x_{split}"], self.data[f"y_{split}"]
                return self.loss_fn(model(x), y).item()
        finally:
            model.train(training)


def run_one(
    task: Task,
    *,
    inner: str,
    method: str,
    outer_lr: float | None,
    n: int,
    h: int,
    seed: int,
    form: str = "plain",
) -> dict:
    """One simulated run of the study (``form`` a key of :data:`FORMS`); a JSON-ready record."""
    cfg = task.cfg
    combine, has_outer = METHODS[method]
    cls, kwargs = INNERS[task.name][inner]
    torch.manual_seed(seed)
    model_init = task.model_fn()
    state = {k: v.clone() for k, v in model_init.state_dict().items()}

    def model_fn() -> nn.Module:
        m = task.model_fn()
        m.load_state_dict(state)
        return m

    def inner_fn(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return getattr(torch.optim, cls)(params, **kwargs)

    def outer_fn(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=outer_lr, momentum=0.9, nesterov=True)

    rounds = cfg["rounds"][str(h)]
    overlap, compression = FORMS[form]
    out = simulate_diloco(
        model_fn,
        task.shards(n, seed),
        sync_every=h,
        combine=combine,
        inner_optimizer_fn=inner_fn,
        outer_optimizer_fn=outer_fn if has_outer else None,
        rounds=rounds,
        loss_fn=task.loss_fn,
        eval_fn=task.evaluate,
        eval_every=cfg["eval_every"][str(h)],
        overlap=overlap,
        compression=compression,
    )
    record = {
        "model": task.name, "inner": inner, "method": method, "combine": combine,
        "outer_lr": outer_lr if has_outer else None, "N": n, "H": h, "rounds": rounds, "seed": seed,
        "history": out["history"], "final_val": out["final"], "diverged": out["diverged"],
        "worker_steps": out["worker_steps"], "wall_s": out["wall_s"], "cpu_s": out["cpu_s"],
        "bytes_per_round": bytes_per_round(out["model"], n, combine, compression),
    }  # fmt: skip
    if form != "plain":
        record["form"] = form
    if task.name in ("mnist", "cnn") and not out["diverged"]:
        record["final_test"] = task.evaluate(out["model"], "test")
    return record


def _key(r: dict) -> tuple:
    return (r["model"], r["inner"], r["method"], r["outer_lr"], r["N"], r["H"], r["seed"], _form(r))


def _form(r: dict) -> str:
    """A run's key of :data:`FORMS` (runs of the main study carry none: ``"plain"``)."""
    return r.get("form", "plain")


def run_study(
    cfg: dict, out_path: Path, *, resume: bool = False, log: Callable[[str], None] | None = None
) -> dict:
    """The outer-lr search (one seed, N = ``search_size``, per model, inner optimizer, H and method with an
    outer optimizer), then every cell with each method at its best lr over ``seeds``. Finished runs are
    written to ``out_path`` after each run; with ``resume`` the runs it already holds are reused (a stopped
    study goes on where it stopped)."""
    log = log or (lambda line: print(line, flush=True))
    old = json.loads(out_path.read_text()) if resume and out_path.exists() else {}
    done = {_key(r): r for r in old.get("runs", [])}
    runs: list[dict] = list(done.values())
    best: dict[str, float] = dict(old.get("best_outer_lr", {}))
    start = time.process_time()

    def get(task: Task, **kw: Any) -> dict:
        probe = {"model": task.name, **kw, "outer_lr": kw["outer_lr"] if METHODS[kw["method"]][1] else None,
                 "N": kw["n"], "H": kw["h"]}  # fmt: skip
        probe["form"] = kw.get("form", "plain")
        if _key(probe) in done:
            return done[_key(probe)]
        rec = run_one(task, **kw)
        done[_key(rec)] = rec
        runs.append(rec)
        log(
            f"{rec['model']} {rec['inner']} {rec['method']} lr={rec['outer_lr']} N={rec['N']} H={rec['H']} "
            f"seed={rec['seed']} {_form(rec)}: val {rec['final_val']:.4f}"
            f"{' DIVERGED' if rec['diverged'] else ''} "
            f"({rec['cpu_s']:.1f} CPU-s)"
        )
        _write(out_path, {"config": cfg, "runs": runs, "best_outer_lr": best})
        return rec

    for model in cfg["models"]:
        mc = cfg[model]
        task = Task(model, mc)
        for inner in mc["inners"]:
            for h in mc["sync_every"]:
                for method in methods_for(mc, inner):
                    if not METHODS[method][1]:
                        continue
                    scores: dict[float, float] = {}
                    lrs = list(mc["outer_lrs"])
                    floor = mc["outer_lrs"][0] / 2 ** mc.get("extend_low", 0)
                    while lrs:
                        lr = lrs.pop(0)
                        r = get(task, inner=inner, method=method, outer_lr=lr, n=mc["search_size"], h=h,
                                seed=mc["search_seed"])  # fmt: skip
                        scores[lr] = math.inf if r["diverged"] else r["final_val"]
                        low = min(scores)  # the best at the grid's low edge: try half of it too
                        if not lrs and min(scores, key=scores.get) == low and low / 2 >= floor:
                            lrs.append(low / 2)
                    best[f"{model}/{inner}/H{h}/{method}"] = min(scores, key=scores.get)
        for inner in mc["inners"]:
            for h in mc["sync_every"]:
                for n in mc["sizes"]:
                    for method in methods_for(mc, inner):
                        lr = best.get(f"{model}/{inner}/H{h}/{method}")
                        for seed in mc["seeds"]:
                            get(task, inner=inner, method=method, outer_lr=lr, n=n, h=h, seed=seed)
        forms = mc.get("forms")
        for inner in forms["inners"] if forms else []:
            for h in forms["sync_every"]:
                for n in forms["sizes"]:
                    for method in forms["methods"]:
                        lr = best[f"{model}/{inner}/H{h}/{method}"]
                        for form in forms["forms"]:
                            for seed in mc["seeds"]:
                                get(task, inner=inner, method=method, outer_lr=lr, n=n, h=h, seed=seed,
                                    form=form)  # fmt: skip
        check = mc.get("aim_check")
        if check:  # the aim's cell at other outer lrs (the search ran at N = search_size)
            for lr in check["outer_lrs"]:
                for seed in mc["seeds"]:
                    get(task, inner=check["inner"], method=check["method"], outer_lr=lr, n=check["N"],
                        h=check["H"], seed=seed)  # fmt: skip
    result = {"config": cfg, "runs": runs, "best_outer_lr": best}
    result["summary"] = summarize(result)
    result["aim"] = aim(result)
    result["forms_summary"] = summarize_forms(result)
    result["cpu_s_this_invocation"] = time.process_time() - start
    result["cpu_s_runs_total"] = sum(r["cpu_s"] for r in runs)
    _write(out_path, result)
    return result


def _write(path: Path, payload: dict) -> None:
    from benchmarks.common import environment

    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": "local_sgd", "environment": environment(), **payload}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    tmp.replace(path)


def _first_round_at_or_below(history: list[list[float]], target: float) -> int | None:
    return next((int(r) for r, v in history if r > 0 and v <= target), None)


def _value_at(history: list[list[float]], rnd: int) -> float:
    """The evaluation at the last evaluated round ≤ ``rnd``."""
    return [v for r, v in history if r <= rnd][-1]


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "std": None, "min": None, "max": None}
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}  # fmt: skip


def _final_runs(result: dict) -> dict[tuple, list[dict]]:
    """The final runs by (model, inner, N, H, method): each method at its best outer lr, the final seeds."""
    cfg, best = result["config"], result["best_outer_lr"]
    out: dict[tuple, list[dict]] = {}
    for r in result["runs"]:
        lr = (
            best.get(f"{r['model']}/{r['inner']}/H{r['H']}/{r['method']}")
            if METHODS[r["method"]][1]
            else None
        )
        if (
            r["outer_lr"] == lr
            and _form(r) == "plain"
            and r["seed"] in cfg[r["model"]]["seeds"]
            and r["N"] in cfg[r["model"]]["sizes"]
        ):
            out.setdefault((r["model"], r["inner"], r["N"], r["H"], r["method"]), []).append(r)
    for rs in out.values():
        rs.sort(key=lambda r: r["seed"])
    return out


def summarize(result: dict) -> list[dict]:
    """Per cell (model, inner, N, H) of the final runs: per method the final validation loss over seeds,
    the rounds to reach the target (averaging + Nesterov's final validation loss, mean over seeds; runs
    that never reach it are counted in ``not_reached``, not in the mean) and the half-run target (its
    validation loss at round R/2, mean over seeds), and the bytes per rank."""
    cfg, final = result["config"], _final_runs(result)
    cells = []
    for model in cfg["models"]:
        mc = cfg[model]
        for inner in mc["inners"]:
            for h in mc["sync_every"]:
                for n in mc["sizes"]:
                    per = {m: final.get((model, inner, n, h, m), []) for m in methods_for(mc, inner)}
                    ref = [r for r in per.get("mean_nesterov", []) if not r["diverged"]]
                    rounds = mc["rounds"][str(h)]
                    target = statistics.fmean(r["final_val"] for r in ref) if ref else None
                    half = (
                        statistics.fmean(_value_at(r["history"], rounds // 2) for r in ref) if ref else None
                    )
                    cell = {"model": model, "inner": inner, "N": n, "H": h, "rounds": rounds,
                            "target": target, "half_target": half, "methods": {}}  # fmt: skip
                    for method, rs in per.items():
                        reached = (
                            [_first_round_at_or_below(r["history"], target) for r in rs] if target else []
                        )
                        reached_half = (
                            [_first_round_at_or_below(r["history"], half) for r in rs] if half else []
                        )
                        cell["methods"][method] = {
                            "outer_lr": rs[0]["outer_lr"] if rs else None,
                            "seeds": [r["seed"] for r in rs],
                            "final_val": _stats([r["final_val"] for r in rs if not r["diverged"]]),
                            "final_test": _stats([r["final_test"] for r in rs if "final_test" in r]),
                            "diverged": sum(r["diverged"] for r in rs),
                            "rounds_to_target": _stats([x for x in reached if x is not None]),
                            "rounds_to_target_per_seed": reached,
                            "not_reached": sum(x is None for x in reached),
                            "rounds_to_half_target": _stats([x for x in reached_half if x is not None]),
                            "rounds_to_half_target_per_seed": reached_half,
                            "bytes_per_round": rs[0]["bytes_per_round"] if rs else None,
                        }
                    cells.append(cell)
    return cells


def aim(result: dict, n: int = 16, h: int = 50, ratio: float = 0.8) -> list[dict]:
    """The aim: at N = 16, H = 50 Adasum (with the outer optimizer, and without) reaches averaging's final
    validation loss in ≤ 0.8 of averaging's outer rounds; per model and inner optimizer, with every seed
    required to reach it."""
    out = []
    for cell in result.get("summary", summarize(result)):
        if cell["N"] != n or cell["H"] != h or cell["target"] is None:
            continue
        for method in ("adasum_nesterov", "adasum_direct"):
            m = cell["methods"].get(method)
            if m is None:
                continue
            per_seed = m["rounds_to_target_per_seed"]
            fractions = [None if x is None else x / cell["rounds"] for x in per_seed]
            held = bool(per_seed) and all(f is not None and f <= ratio for f in fractions)
            out.append(
                {
                    "model": cell["model"],
                    "inner": cell["inner"],
                    "method": method,
                    "outer_lr": m["outer_lr"],
                    "target": cell["target"],
                    "rounds_of_averaging": cell["rounds"],
                    "rounds_to_target_per_seed": per_seed,
                    "fraction_per_seed": fractions,
                    "final_val": m["final_val"],
                    "held": held,
                }
            )
            check = result["config"][cell["model"]].get("aim_check") or {}
            if (check.get("inner"), check.get("method"), check.get("N"), check.get("H")) != (
                cell["inner"],
                method,
                n,
                h,
            ):
                continue
            for lr in check["outer_lrs"]:
                rs = [
                    r
                    for r in result["runs"]
                    if (r["model"], r["inner"], r["method"], r["outer_lr"], r["N"], r["H"], _form(r))
                    == (cell["model"], cell["inner"], method, lr, n, h, "plain")
                    and r["seed"] in result["config"][cell["model"]]["seeds"]
                ]
                per_seed = [_first_round_at_or_below(r["history"], cell["target"]) for r in rs]
                fractions = [None if x is None else x / cell["rounds"] for x in per_seed]
                out.append(
                    {
                        "model": cell["model"],
                        "inner": cell["inner"],
                        "method": method,
                        "outer_lr": lr,
                        "target": cell["target"],
                        "rounds_of_averaging": cell["rounds"],
                        "rounds_to_target_per_seed": per_seed,
                        "fraction_per_seed": fractions,
                        "final_val": _stats([r["final_val"] for r in rs if not r["diverged"]]),
                        "held": bool(per_seed) and all(f is not None and f <= ratio for f in fractions),
                        "note": "outer lr other than the searched best",
                    }
                )
    return out


def summarize_forms(result: dict) -> list[dict]:
    """Per cell (model, inner, N, H) of a model's ``forms`` config: per method and form (``plain`` from the
    main study) the final validation loss over seeds, its change from ``plain`` paired by seed, and the
    rounds to averaging's final loss (the main study's target: mean + Nesterov, plain)."""
    cfg, best = result["config"], result["best_outer_lr"]
    targets = {(c["model"], c["inner"], c["N"], c["H"]): c["target"] for c in result["summary"]}
    runs: dict[tuple, dict[int, dict]] = {}
    for r in result["runs"]:
        key = (r["model"], r["inner"], r["N"], r["H"], r["method"], _form(r))
        if r["outer_lr"] == best.get(f"{r['model']}/{r['inner']}/H{r['H']}/{r['method']}"):
            runs.setdefault(key, {})[r["seed"]] = r
    cells = []
    for model in cfg["models"]:
        mc, fc = cfg[model], cfg[model].get("forms")
        for inner in fc["inners"] if fc else []:
            for h in fc["sync_every"]:
                for n in fc["sizes"]:
                    target = targets.get((model, inner, n, h))
                    cell = {"model": model, "inner": inner, "N": n, "H": h, "rounds": mc["rounds"][str(h)],
                            "target": target, "methods": {}}  # fmt: skip
                    for method in fc["methods"]:
                        plain = runs.get((model, inner, n, h, method, "plain"), {})
                        cell["methods"][method] = per_form = {}
                        for form in ["plain", *fc["forms"]]:
                            got = runs.get((model, inner, n, h, method, form), {})
                            rs = [got[s] for s in mc["seeds"] if s in got]
                            ok = [r for r in rs if not r["diverged"]]
                            reached = (
                                [_first_round_at_or_below(r["history"], target) for r in rs] if target else []
                            )
                            paired = [r["final_val"] - plain[r["seed"]]["final_val"] for r in ok
                                      if r["seed"] in plain and not plain[r["seed"]]["diverged"]]  # fmt: skip
                            worth = [_first_round_at_or_below(plain[r["seed"]]["history"], r["final_val"])
                                     for r in ok if r["seed"] in plain]  # fmt: skip
                            per_form[form] = {
                                "outer_lr": rs[0]["outer_lr"] if rs else None,
                                "seeds": [r["seed"] for r in rs],
                                "final_val": _stats([r["final_val"] for r in ok]),
                                "change_from_plain": _stats(paired),
                                "diverged": len(rs) - len(ok),
                                "rounds_to_target": _stats([x for x in reached if x is not None]),
                                "rounds_to_target_per_seed": reached,
                                "bytes_per_round": rs[0]["bytes_per_round"] if rs else None,
                                "plain_rounds_to_final": _stats([x for x in worth if x is not None]),
                                "plain_rounds_to_final_per_seed": worth,
                                "cpu_s": sum(r["cpu_s"] for r in rs),
                            }
                    cells.append(cell)
    return cells


# ---------------------------------------------------------------------------------------------------------
# Plots and tables

MODEL_NAMES = {"mnist": "MNIST MLP", "cnn": "MNIST CNN", "lm": "char-level transformer"}
LABELS = {
    "adasum_nesterov": "Adasum + Nesterov",
    "mean_nesterov": "mean + Nesterov (DiLoCo)",
    "adasum_direct": "Adasum, no outer opt.",
    "mean_direct": "mean, no outer opt. (local SGD)",
}
COLORS = {"adasum_nesterov": "tab:red", "mean_nesterov": "tab:blue", "adasum_direct": "tab:orange",
          "mean_direct": "tab:cyan"}  # fmt: skip


def plot(result: dict, docs: Path) -> list[Path]:
    """``local_sgd_curves_<model>_<inner>.png`` (validation loss vs outer round, rows H, columns N, mean
    over seeds with the min–max band) and ``local_sgd_rounds_to_target.png``; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, paths = result["config"], []
    final = _final_runs(result)
    for model in cfg["models"]:
        mc = cfg[model]
        for inner in mc["inners"]:
            hs, ns = mc["sync_every"], mc["sizes"]
            fig, axes = plt.subplots(len(hs), len(ns), figsize=(3.6 * len(ns), 2.8 * len(hs)), squeeze=False)
            for i, h in enumerate(hs):
                for j, n in enumerate(ns):
                    ax = axes[i][j]
                    for method in methods_for(mc, inner):
                        rs = final.get((model, inner, n, h, method), [])
                        if not rs:
                            continue
                        rounds = [x for x, _ in rs[0]["history"]]
                        curves = [
                            [v for _, v in r["history"]] for r in rs if len(r["history"]) == len(rounds)
                        ]
                        if not curves:
                            continue
                        mean = [statistics.fmean(c[k] for c in curves) for k in range(len(rounds))]
                        lo = [min(c[k] for c in curves) for k in range(len(rounds))]
                        hi = [max(c[k] for c in curves) for k in range(len(rounds))]
                        lr = rs[0]["outer_lr"]
                        label = LABELS[method] + (f", lr {lr}" if lr is not None else "")
                        ax.plot(rounds, mean, color=COLORS[method], label=label, lw=1.4)
                        ax.fill_between(rounds, lo, hi, color=COLORS[method], alpha=0.2, lw=0)
                    ax.set_title(f"N = {n}, H = {h}", fontsize=9)
                    ax.set_yscale("log")
                    ax.grid(alpha=0.3, which="both")
                    if i == len(hs) - 1:
                        ax.set_xlabel("outer round")
                    if j == 0:
                        ax.set_ylabel("validation loss")
                    ax.legend(fontsize=6)
            what = MODEL_NAMES[model]
            fig.suptitle(
                f"{what}, inner {inner}: validation loss per outer round (mean of seeds, min–max band)"
            )
            fig.tight_layout()
            path = docs / f"local_sgd_curves_{model}_{inner}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            paths.append(path)
    groups = [(m, i) for m in cfg["models"] for i in cfg[m]["inners"]]
    fig, axes = plt.subplots(len(groups), 1, figsize=(11, 2.9 * len(groups)), squeeze=False)
    for ax, (model, inner) in zip(axes[:, 0], groups, strict=True):
        cells = [c for c in result["summary"] if c["model"] == model and c["inner"] == inner]
        methods = methods_for(cfg[model], inner)
        width = 0.8 / len(methods)
        never = 1.1  # where a seed that never reached the target is drawn
        for k, method in enumerate(methods):
            xs, ys, dots = [], [], []
            for ci, c in enumerate(cells):
                m = c["methods"].get(method)
                if m is None:
                    continue
                frac = [never if x is None else x / c["rounds"] for x in m["rounds_to_target_per_seed"]]
                x = ci + (k - (len(methods) - 1) / 2) * width
                xs.append(x)
                ys.append(statistics.median(frac) if frac else 0.0)
                dots += [(x, f) for f in frac]
            ax.bar(xs, ys, width, color=COLORS[method], label=LABELS[method], alpha=0.75)
            ax.scatter([d[0] for d in dots], [d[1] for d in dots], s=8, color="k", zorder=3)
        ax.axhline(0.8, color="k", ls="--", lw=0.8)
        ax.axhline(1.0, color="grey", ls=":", lw=0.8)
        ax.set_xticks(range(len(cells)), [f"N{c['N']} H{c['H']}" for c in cells], fontsize=7)
        ax.set_ylabel("rounds to target / R")
        ax.set_ylim(0, 1.3)
        title = f"{model}, inner {inner}: outer rounds to averaging's final validation loss, fraction of R"
        ax.set_title(f"{title} (bar: median of seeds, dots: seeds; {never}: never reached)", fontsize=9)
        ax.legend(fontsize=7, ncol=4, loc="lower right")
    fig.tight_layout()
    path = docs / "local_sgd_rounds_to_target.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
    return paths


def _fmt(s: dict, digits: int = 4) -> str:
    if s["mean"] is None:
        return "—"
    return f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f}"


def _rounds(s: dict, per_seed: list) -> str:
    if not per_seed:
        return "—"
    reached = f"{sum(x is not None for x in per_seed)}/{len(per_seed)}"
    return reached if s["mean"] is None else f"{s['mean']:.1f} ± {s['std']:.1f} ({reached})"


def tables(result: dict) -> str:
    """Markdown tables of the summary, two per model and inner optimizer (one row per N, H): the final
    validation loss of each method (its outer lr), and the rounds to reach the two targets."""
    lines = []
    cfg = result["config"]
    for model in cfg["models"]:
        for inner in cfg[model]["inners"]:
            methods = methods_for(cfg[model], inner)
            cells = [c for c in result["summary"] if (c["model"], c["inner"]) == (model, inner)]
            head = ["N", "H", "R", *(LABELS[m] for m in methods)]
            lines += [f"Final validation loss, {model}, inner {inner} (mean ± std over seeds; outer lr):", ""]
            lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            for c in cells:
                row = [str(c["N"]), str(c["H"]), str(c["rounds"])]
                for m in methods:
                    s = c["methods"][m]
                    div = f", {s['diverged']} diverged" if s["diverged"] else ""
                    lr = f" (lr {s['outer_lr']}{div})" if s["outer_lr"] else (f" ({div[2:]})" if div else "")
                    row.append(_fmt(s["final_val"]) + lr)
                lines.append("| " + " | ".join(row) + " |")
            lines += [
                "",
                f"Outer rounds to averaging's final loss / to its loss at R/2, {model}, inner {inner} "
                "(mean ± std over the seeds that reach it; reached/seeds):",
                "",
            ]
            head = ["N", "H", "R", "target", "R/2 target", *(LABELS[m] for m in methods)]
            lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            for c in cells:
                row = [str(c["N"]), str(c["H"]), str(c["rounds"])]
                row += [
                    f"{c['target']:.4f}" if c["target"] else "—",
                    f"{c['half_target']:.4f}" if c["half_target"] else "—",
                ]
                for m in methods:
                    s = c["methods"][m]
                    row.append(
                        _rounds(s["rounds_to_target"], s["rounds_to_target_per_seed"])
                        + " / "
                        + _rounds(s["rounds_to_half_target"], s["rounds_to_half_target_per_seed"])
                    )
                lines.append("| " + " | ".join(row) + " |")
            lines.append("")
    return "\n".join(lines)


FORM_LABELS = {"plain": "plain", "bf16": "+bf16", "overlap": "+overlap", "overlap_bf16": "+overlap +bf16"}


def forms_tables(result: dict) -> str:
    """Markdown tables of :func:`summarize_forms`, two per model and inner optimizer (one row per N, H and
    method): the final validation loss of each form with its change from plain, and the rounds to
    averaging's final loss."""
    lines: list[str] = []
    for model, inner in dict.fromkeys((c["model"], c["inner"]) for c in result.get("forms_summary", [])):
        cells = [c for c in result["forms_summary"] if (c["model"], c["inner"]) == (model, inner)]
        forms = list(cells[0]["methods"][next(iter(cells[0]["methods"]))])
        head = ["N", "H", "R", "method", *(FORM_LABELS[f] for f in forms)]
        lines += [f"Final validation loss, {model}, inner {inner} (mean ± std over seeds; in brackets the "
                  "change from plain, mean ± std of the per-seed differences):", ""]  # fmt: skip
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for c in cells:
            for method, per in c["methods"].items():
                row = [
                    str(c["N"]),
                    str(c["H"]),
                    str(c["rounds"]),
                    f"{LABELS[method]} (lr {per['plain']['outer_lr']})",
                ]
                for f in forms:
                    s = per[f]
                    div = f", {s['diverged']} diverged" if s["diverged"] else ""
                    change = s["change_from_plain"]
                    diff = (
                        f" ({change['mean']:+.2g} ± {change['std']:.2g}{div})"
                        if f != "plain" and change["mean"] is not None
                        else (f" ({div[2:]})" if div else "")
                    )
                    row.append(_fmt(s["final_val"]) + diff)
                lines.append("| " + " | ".join(row) + " |")
        lines += ["", f"Outer rounds to averaging's final loss (plain mean + Nesterov), {model}, inner "
                  f"{inner} (mean ± std over the seeds that reach it; reached/seeds):", ""]  # fmt: skip
        head = ["N", "H", "R", "target", "method", *(FORM_LABELS[f] for f in forms)]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for c in cells:
            for method, per in c["methods"].items():
                row = [str(c["N"]), str(c["H"]), str(c["rounds"]),
                       f"{c['target']:.4f}" if c["target"] else "—", LABELS[method]]  # fmt: skip
                row += [
                    _rounds(per[f]["rounds_to_target"], per[f]["rounds_to_target_per_seed"]) for f in forms
                ]
                lines.append("| " + " | ".join(row) + " |")
        lines += ["", "What R rounds of each form are worth: the rounds the plain run (same method and seed) "
                  f"takes to reach the form's final loss, {model}, inner {inner} (mean ± std; "
                  "reached/seeds):", ""]  # fmt: skip
        head = ["N", "H", "R", "method", *(FORM_LABELS[f] for f in forms[1:])]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for c in cells:
            for method, per in c["methods"].items():
                row = [str(c["N"]), str(c["H"]), str(c["rounds"]), LABELS[method]]
                row += [
                    _rounds(per[f]["plain_rounds_to_final"], per[f]["plain_rounds_to_final_per_seed"])
                    for f in forms[1:]
                ]
                lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the reduced configuration (about a minute)")
    p.add_argument("--models", default=None, help="comma-separated subset of mnist,cnn,lm")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results JSON (default benchmarks/results/[quick/]local_sgd.json)",
    )
    p.add_argument(
        "--docs", type=Path, default=None, help="folder for the PNGs (default docs/; quick: next to the JSON)"
    )
    p.add_argument("--resume", action="store_true", help="reuse the runs --out already holds")
    p.add_argument(
        "--report-only", action="store_true", help="re-summarise, plot and print the tables of --out"
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cfg = json.loads(json.dumps(QUICK if args.quick else FULL))
    if args.models:
        cfg["models"] = args.models.split(",")
    results = ROOT / "benchmarks" / "results"
    out = args.out or (results / "quick" / "local_sgd.json" if args.quick else results / "local_sgd.json")
    docs = args.docs or (out.parent if args.quick else ROOT / "docs")
    if args.report_only:
        result = json.loads(out.read_text())
        result["summary"] = summarize(result)
        result["aim"] = aim(result)
        result["forms_summary"] = summarize_forms(result)
        _write(out, {k: v for k, v in result.items() if k not in ("benchmark", "environment")})
    else:
        result = run_study(cfg, out, resume=args.resume)
    for path in plot(result, docs):
        print(f"wrote {path}")
    print(tables(result))
    print(forms_tables(result))
    for a in result["aim"]:
        print(f"aim N=16 H=50 {a['model']} {a['inner']} {a['method']}: fractions {a['fraction_per_seed']} "
              f"held={a['held']}")  # fmt: skip


if __name__ == "__main__":
    main()
