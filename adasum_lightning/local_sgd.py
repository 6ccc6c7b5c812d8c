"""Communicate every H steps: local SGD, and DiLoCo's outer step, with the ranks' updates combined by Adasum.

Every rank takes ``sync_every`` (H) local optimizer steps without communicating, from the parameters of
the last sync θ_sync. Then the pseudo-gradients Δ_r = θ_r − θ_sync are combined over the ranks — by Adasum
per parameter tensor (:func:`adasum_lightning.allreduce.adasum_allreduce_flat`) or by their mean — and every
rank sets θ_sync ← θ_sync + combined Δ, or lets an outer optimizer step θ_sync with −(combined Δ) as its
gradient (DiLoCo: Douillard et al., 2023, https://arxiv.org/abs/2311.08105; torchft's ``local_sgd.py``).
Each rank keeps its own inner optimizer state; the outer state is the same on every rank.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import partial
from itertools import accumulate
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from adasum_lightning.allreduce import adasum_allreduce_flat, mean_allreduce_flat, workspace
from adasum_lightning.step import adasum_step, world_size

__all__ = ["COMBINES", "PERIODIC_SYNC_STATES", "PeriodicSync"]

#: The ways the ranks' pseudo-gradients are combined.
COMBINES = ("adasum", "mean")

#: The checkpoint key of the strategies' windows: per optimizer, :meth:`PeriodicSync.state_dict` without
#: θ_sync (a checkpoint is written after a sync, where θ_sync is the parameters).
PERIODIC_SYNC_STATES = "adasum_periodic_sync_states"

T = TypeVar("T")


class PeriodicSync:
    """The parameters of one optimizer, synchronised every ``sync_every`` local steps (see the module).

    With ``sync_every=1``, ``combine="adasum"`` and no outer optimizer this is
    :func:`adasum_lightning.step.adasum_step`, the same parameters bitwise. Otherwise it keeps a copy of
    θ_sync (one copy of ``params``) and one flat buffer of the pseudo-gradients per dtype and device (a
    kept workspace: a fresh one per sync would cost page faults on every sync). Every rank must call
    :meth:`step` and :meth:`sync` at the same steps.

    Args:
        params: the parameters the local steps change (same shapes, dtypes and order on every rank).
        sync_every: local optimizer steps per sync (H ≥ 1).
        combine: ``"adasum"`` or ``"mean"``.
        outer_optimizer: None (θ_sync + combined Δ), or an optimizer over ``params`` that steps θ_sync with
            −(combined Δ) as the gradient.
        group, timeout: the process group (default: the default group) and how long one exchange waits.
        wire_dtype: None, or the dtype every piece the combination sends is rounded to (``wire_dtype`` of
            :mod:`adasum_lightning.allreduce`'s functions); θ_sync and the parameters keep their own dtype.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        sync_every: int = 1,
        combine: str = "adasum",
        outer_optimizer: Optimizer | None = None,
        group: dist.ProcessGroup | None = None,
        timeout: timedelta | None = None,
        wire_dtype: torch.dtype | None = None,
    ) -> None:
        self.params = list(params)
        self.sync_every = sync_every
        self.combine = combine
        self.outer_optimizer = outer_optimizer
        self.group = group
        self.timeout = timeout
        self.wire_dtype = wire_dtype
        #: Local steps since the last sync.
        self.steps = 0
        self._synced: list[torch.Tensor] | None = None if self.every_step else self._copy()

    @property
    def every_step(self) -> bool:
        """True when each step is an Adasum step (no window, no outer optimizer)."""
        return self.sync_every == 1 and self.combine == "adasum" and self.outer_optimizer is None

    def step(self, local_step: Callable[[], T]) -> T:
        """Run ``local_step`` (this rank's optimizer step); sync when it ends a window. Returns its value."""
        if self.every_step:
            return adasum_step(self.params, local_step, self.group, self.timeout, self.wire_dtype)
        output = local_step()
        self.steps += 1
        if self.steps >= self.sync_every:
            self.sync()
        return output

    @torch.no_grad()
    def sync(self) -> None:
        """End the window now: combine the pseudo-gradients and set every rank's parameters to θ_sync.

        A window without local steps changes nothing (the ranks hold θ_sync already).
        """
        if self.every_step or self.steps == 0:
            return
        self.steps = 0
        assert self._synced is not None
        size = world_size(self.group)
        buckets: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i, p in enumerate(self.params):
            if p.numel():
                buckets.setdefault((p.dtype, p.device), []).append(i)
        saved_grads = [p.grad for p in self.params]
        for (dtype, device), indices in buckets.items():
            params = [self.params[i] for i in indices]
            synced = [self._synced[i] for i in indices]
            offsets = list(accumulate((p.numel() for p in params), initial=0))
            flat = workspace(offsets[-1], dtype, device, slot="periodic-delta")
            for p, s, at in zip(params, synced, offsets, strict=False):
                torch.sub(p.detach().reshape(-1), s.reshape(-1), out=flat[at : at + p.numel()])
            # Without an outer optimizer each range of θ_sync is set as soon as the allreduce has its result.
            apply = None
            if self.outer_optimizer is None and all(p.is_contiguous() for p in params):
                apply = partial(_apply_deltas, params, synced, offsets, flat)
            if size > 1 and self.combine == "adasum":
                counts = [p.numel() for p in params]
                adasum_allreduce_flat(flat, counts, self.group, self.timeout, apply, self.wire_dtype)
            else:
                if size > 1:
                    mean_allreduce_flat(flat, self.group, self.wire_dtype)
                if apply is not None:
                    apply(0, offsets[-1])
            if apply is None:
                for p, s, at in zip(params, synced, offsets, strict=False):
                    delta = flat[at : at + p.numel()].view(p.shape)
                    if self.outer_optimizer is None:
                        torch.add(s, delta, out=p.data)
                        s.copy_(p.detach())
                    else:
                        p.data.copy_(s)
                        p.grad = delta.neg()
        if self.outer_optimizer is not None:
            with torch.enable_grad():
                self.outer_optimizer.step()
            for p, grad in zip(self.params, saved_grads, strict=True):
                p.grad = grad
            for p, s in zip(self.params, self._synced, strict=True):
                s.copy_(p.detach())

    def state_dict(self) -> dict[str, Any]:
        """The position in the window, θ_sync and the outer optimizer's state (the same on every rank)."""
        return {
            "steps": self.steps,
            "synced": None if self._synced is None else [s.clone() for s in self._synced],
            "outer_optimizer": None if self.outer_optimizer is None else self.outer_optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (the parameters themselves are restored elsewhere)."""
        self.steps = int(state["steps"])
        if self._synced is not None and state["synced"] is not None:
            for s, saved in zip(self._synced, state["synced"], strict=True):
                s.copy_(saved)
        if self.outer_optimizer is not None and state["outer_optimizer"] is not None:
            self.outer_optimizer.load_state_dict(state["outer_optimizer"])

    def _copy(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.params]


def _apply_deltas(
    params: list[torch.Tensor],
    synced: list[torch.Tensor],
    offsets: list[int],
    flat: torch.Tensor,
    start: int,
    length: int,
) -> None:
    """θ := θ_sync + Δ, then θ_sync := θ, on the elements ``[start, start + length)`` of the parameters packed
    back to back (contiguous ``params``; tensor ``i`` at ``offsets[i]``), Δ being ``flat``'s combined
    pseudo-gradients. Done range by range, each range's second pass reads what the first left in cache."""
    end = start + length
    i = bisect_right(offsets, start) - 1
    while start < end:
        lo, hi = offsets[i], min(offsets[i + 1], end)
        if hi > start:
            p = params[i].detach().view(-1)[start - lo : hi - lo]
            s = synced[i].view(-1)[start - lo : hi - lo]
            torch.add(s, flat[start:hi], out=p)
            s.copy_(p)
            start = hi
        i += 1
