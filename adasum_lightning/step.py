"""The Adasum step, once for every training loop: capture, local step, deltas, Adasum, write back.

The ``ddp_adasum`` Trainer strategy, the ``ddp_adasum`` Fabric strategy and :class:`~adasum_lightning.
AdasumOptimizer` (a plain ``torch.distributed`` loop) all update the parameters through
:func:`adasum_step`; they differ only in what their local step is (Lightning's precision plugin and closure,
Fabric's precision plugin, or the wrapped optimizer's ``step``). Needs ``torch`` only.

Semantics (Horovod 0.28.1's ``_DistributedAdasumOptimizer``, ``horovod/torch/optimizer.py``, taken after the
whole backward pass): every rank runs its own optimizer step from the same parameters θ, giving
``d_r = θ_r − θ``; every rank then sets ``θ := θ + Adasum(d_0, …, d_{N−1})`` (Maleki et al., MLSys 2021), so
the ranks stay identical while each keeps its own optimizer state. No learning-rate scaling by world size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from adasum_lightning.allreduce import adasum_allreduce_flat, workspace

__all__ = ["adasum_step", "optimizer_parameters", "broadcast_from_rank_zero", "world_size"]

T = TypeVar("T")


def world_size(group: dist.ProcessGroup | None = None) -> int:
    """The size of ``group`` (default: the default group); 1 when ``torch.distributed`` is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def optimizer_parameters(optimizer: Optimizer) -> list[torch.Tensor]:
    """Every parameter of ``optimizer``'s param groups, in group order, each once (frozen ones included:
    their delta is zero)."""
    seen: dict[int, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            seen.setdefault(id(p), p)
    return list(seen.values())


def adasum_step(
    params: Sequence[torch.Tensor],
    local_step: Callable[[], T],
    group: dist.ProcessGroup | None = None,
    timeout: timedelta | None = None,
) -> T:
    """Run ``local_step`` (this rank's optimizer step), then replace its update of ``params`` by the Adasum of
    every rank's update: ``θ := θ_before + Adasum(θ_after − θ_before over the ranks)``.

    Every rank of ``group`` must call this for the same ``params`` (same shapes, dtypes, order) at the same
    step; a rank whose local step changes nothing (a step skipped by a gradient scaler, a parameter without a
    gradient) contributes a zero delta, which Adasum leaves out.

    Three passes over the parameters, into buffers kept between steps (per thread, dtype and device, like the
    reduction's own; :func:`adasum_lightning.allreduce.release_workspace` frees them): ``θ_before`` is packed
    into one flat buffer before the local step; after it the deltas are written straight into the flat bucket
    the reduction works on (:func:`adasum_lightning.allreduce.adasum_allreduce_flat`); the result is written
    straight back as ``θ_before + Adasum``. Memory: two flat copies of ``params`` (``θ_before``, the deltas)
    plus the reduction's receive buffer (half a copy, or a whole one below the tree threshold).

    Args:
        params: the parameters the local step may change (floating-point; any layout).
        local_step: runs the local step; its return value is returned.
        group: the process group (default: the default group). With world size 1 (or no process group) this is
            ``local_step()`` alone.
        timeout: how long one exchange waits for a peer (see :func:`adasum_lightning.adasum_allreduce`).

    Raises:
        TypeError: a parameter's dtype is not one the reduction supports (the message names it).
        RuntimeError: from ``torch.distributed`` when a peer is lost or does not answer within ``timeout``.
    """
    if world_size(group) == 1:
        return local_step()
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for p in params:
        if p.numel():
            buckets.setdefault((p.dtype, p.device), []).append(p)
    starts = {}
    with torch.no_grad():
        for (dtype, device), bucket in buckets.items():
            before = workspace(sum(p.numel() for p in bucket), dtype, device, "step-before")
            torch.cat([p.detach().reshape(-1) for p in bucket], out=before)
            starts[dtype, device] = before
    output = local_step()
    with torch.no_grad():
        for key, bucket in buckets.items():
            before = starts[key]
            delta = workspace(before.numel(), key[0], key[1], "step-delta")
            pairs = list(zip(bucket, _views(before, bucket), _views(delta, bucket), strict=True))
            for p, start, d in pairs:
                torch.sub(p.detach(), start, out=d)
            adasum_allreduce_flat(delta, [p.numel() for p in bucket], group=group, timeout=timeout)
            for p, start, d in pairs:
                torch.add(start, d, out=p.data)
    return output


def _views(flat: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``flat`` cut into consecutive pieces shaped like ``tensors``."""
    views, offset = [], 0
    for t in tensors:
        views.append(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return views


def broadcast_from_rank_zero(tensors: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None) -> None:
    """Give every rank of ``group`` the values of its first rank, in place (no-op at world size 1).

    ``bool`` tensors travel as ``uint8`` (Gloo has no bool broadcast); non-contiguous tensors through a
    contiguous copy.
    """
    if world_size(group) == 1:
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for t in tensors:
            buffer = t.data if t.is_contiguous() else t.data.contiguous()
            wire = buffer.view(torch.uint8) if buffer.dtype == torch.bool else buffer
            dist.broadcast(wire, src=src, group=group)
            if buffer is not t.data:
                t.data.copy_(buffer)
