"""Communicate every H steps: local SGD and DiLoCo's outer step, the ranks' updates combined by Adasum.

The pseudo-gradients Δ_r = θ_r − θ_sync of ``sync_every`` local steps are combined (Adasum or mean) and added
to θ_sync, or stepped by an outer optimizer (DiLoCo: Douillard et al., 2023). docs/local_sgd.md.
"""

from __future__ import annotations

import numbers
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from functools import partial
from itertools import accumulate
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from adasum_lightning.allreduce import adasum_allreduce_flat, mean_allreduce_flat, workspace
from adasum_lightning.errors import AdasumConfigurationError, reported_on_every_rank
from adasum_lightning.step import adasum_step, optimizer_parameters, world_size

__all__ = [
    "COMBINES",
    "PeriodicSync",
    "check_sync_every",
    "check_outer_optimizer_form",
    "check_outer_optimizer",
    "local_sgd_without_outer_message",
    "periodic_sync",
    "close_windows",
]

#: The ways the ranks' pseudo-gradients are combined.
COMBINES = ("adasum", "mean")
#: Elements per piece of a window end's fused pass (:meth:`PeriodicSync._shift_window`): its four float32
#: tensors' pieces (2 MiB) stay in cache between the pass's five operations.
SHIFT_CHUNK = 1 << 17

T = TypeVar("T")


def check_sync_every(
    sync_every: object,
    combine: object,
    owner: str,
    overlap_backward: bool = False,
    outer_optimizer: bool = False,
    overlap_sync: bool = False,
) -> None:
    """Check the local-SGD options and how they go with ``overlap_backward`` and ``overlap_sync``. Raises
    ``AdasumConfigurationError``: the value that is off and the accepted ones."""
    if isinstance(sync_every, bool) or not isinstance(sync_every, numbers.Integral) or sync_every < 1:
        raise AdasumConfigurationError(
            f"{owner}'s sync_every is the number of local optimizer steps between syncs, a whole number ≥ 1 "
            f"(1: combine every step), got {sync_every!r}"
        )
    if combine not in ("adasum", "mean"):
        raise AdasumConfigurationError(
            f"{owner}'s combine is 'adasum' (orthogonal pseudo-gradients add, parallel ones average) or "
            f"'mean' (their average, as local SGD and DiLoCo do), got {combine!r}"
        )
    if overlap_sync and overlap_backward:
        raise AdasumConfigurationError(
            f"{owner}: overlap_sync=True and overlap_backward=True overlap different exchanges; pass one of "
            "them (overlap_sync with sync_every > 1, overlap_backward with sync_every=1)."
        )
    if overlap_sync and sync_every == 1:
        raise AdasumConfigurationError(
            f"{owner}: overlap_sync=True runs a window's exchange during the next window, which sync_every=1 "
            "does not have: pass sync_every > 1, or overlap_sync=False."
        )
    if overlap_backward and (sync_every > 1 or combine != "adasum" or outer_optimizer):
        given = f"sync_every={sync_every}" if sync_every > 1 else f"combine={combine!r}"
        given = "an outer optimizer" if sync_every == 1 and combine == "adasum" else given
        raise AdasumConfigurationError(
            f"{owner}: overlap_backward=True combines every step by Adasum during backward, which {given} "
            "does not: pass overlap_backward=False with local SGD (sync_every, combine, outer_optimizer)."
        )


#: The outer optimizer as the strategies take it (``builder``), and as ``AdasumOptimizer`` takes it.
_OUTER_OPTIMIZER_FORMS = {
    True: "a callable such as functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, nesterov=True)",
    False: "an optimizer over the same parameters, e.g. torch.optim.SGD(model.parameters(), lr=0.1, "
    "momentum=0.9, nesterov=True)",
}


def check_outer_optimizer_form(owner: str, outer: object, builder: bool) -> None:
    """``outer`` is None, a callable building the optimizer (``builder``: the strategies) or an optimizer.
    Raises ``AdasumConfigurationError``: the other form, or a class (it would step with its default learning
    rate)."""
    if outer is None:
        return
    if isinstance(outer, type) and issubclass(outer, torch.optim.Optimizer):
        raise AdasumConfigurationError(
            f"{owner}'s outer_optimizer is the class {outer.__name__}, which would step with its default "
            f"learning rate: pass {_OUTER_OPTIMIZER_FORMS[builder]}, the outer learning rate named"
        )
    is_optimizer = isinstance(outer, torch.optim.Optimizer)
    if builder and (is_optimizer or not callable(outer)):
        raise AdasumConfigurationError(
            f"{owner}'s outer_optimizer builds the outer optimizer from an optimizer's parameters (one per "
            f"optimizer, at its first step): pass {_OUTER_OPTIMIZER_FORMS[True]}, got {type(outer).__name__}"
        )
    if not builder and not is_optimizer:
        raise AdasumConfigurationError(
            f"{owner}'s outer_optimizer is {_OUTER_OPTIMIZER_FORMS[False]}, got {type(outer).__name__}"
        )


def check_outer_optimizer(owner: str, inner: Sequence[int], outer: Sequence[int], builder: bool) -> None:
    """The outer optimizer steps exactly the inner optimizer's parameters (``inner``, ``outer``: their ids).
    Raises ``AdasumConfigurationError``: naming how many parameters differ."""
    missing, extra = len(set(inner) - set(outer)), len(set(outer) - set(inner))
    if missing or extra:
        raise AdasumConfigurationError(
            f"{owner}: the outer optimizer must step the same parameters as the inner one ({missing} of the "
            f"inner optimizer's parameters missing, {extra} others): pass {_OUTER_OPTIMIZER_FORMS[builder]}"
            f"{', which builds it from them' if builder else ''}."
        )


def local_sgd_without_outer_message(owner: str, sync_every: int) -> str:
    """The warning for the Adasum of windows of several steps applied without an outer optimizer."""
    return (
        f"{owner}: sync_every={sync_every} with combine='adasum' and no outer optimizer adds the Adasum of "
        "many-step pseudo-gradients at once, which overshoots (docs/local_sgd.md): pass an outer optimizer "
        "with a small learning rate, e.g. functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, "
        "nesterov=True), or combine='mean'."
    )


class PeriodicSync:
    """The parameters of one optimizer, synchronised every ``sync_every`` local steps (see the module).

    With ``sync_every=1``, ``combine="adasum"`` and no outer optimizer this is
    :func:`~adasum_lightning.step.adasum_step`. Every rank calls :meth:`step` and :meth:`sync` at the same
    steps. With ``overlap_sync`` window k's exchange runs in a worker thread during window k + 1 and is
    applied one window late (docs/local_sgd.md, "The sync behind compute").

    Args:
        params: the parameters the local steps change (same shapes, dtypes and order on every rank).
        sync_every: local optimizer steps per sync (H ≥ 1).
        combine: ``"adasum"`` or ``"mean"``.
        outer_optimizer: None, or an optimizer over ``params`` stepping θ_sync with −(combined Δ).
        group, timeout, wire_dtype: as for :func:`adasum_lightning.allreduce.adasum_allreduce_flat`.
        overlap_sync: run each window's exchange behind the next window's local steps (H ≥ 2).
        overlap_group: the worker thread's process group (default ``group``).
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
        overlap_sync: bool = False,
        overlap_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.params = list(params)
        self.sync_every = sync_every
        self.combine = combine
        self.outer_optimizer = outer_optimizer
        self.group = group
        self.timeout = timeout
        self.wire_dtype = wire_dtype
        self.overlap_sync = overlap_sync
        self.overlap_group = group if overlap_group is None else overlap_group
        #: Local steps since the last sync.
        self.steps = 0
        self._synced: list[torch.Tensor] | None = None if self.every_step else self._copy()
        # overlap_sync: this rank's window start s, the send buffers, the exchange in flight, its thread
        self._start = self._copy() if overlap_sync else None
        self._send: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self._pending: tuple[Future, list[_Packed]] | None = None
        self._worker: ThreadPoolExecutor | None = None

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
            self._end_overlapped(flush=False) if self.overlap_sync else self.sync()
        return output

    @torch.no_grad()
    def sync(self) -> None:
        """End the window now: combine the pseudo-gradients and set every rank's parameters to θ_sync. Raises
        ``RuntimeError``: from ``torch.distributed``, also what the exchange in flight raised."""
        if self.overlap_sync:
            return self._end_overlapped(flush=True)
        if self.every_step or self.steps == 0:
            return
        self.steps = 0
        packed = self._pack(self._synced)
        # Without an outer optimizer each range of θ_sync is set as soon as the allreduce has its result.
        apply = self.outer_optimizer is None and all(p.is_contiguous() for p in self.params)
        for indices, offsets, flat in packed:
            params = [self.params[i] for i in indices]
            synced = [self._synced[i] for i in indices]  # type: ignore[index]
            on_final = partial(_apply_deltas, params, synced, offsets, flat) if apply else None
            self._combine(flat, _counts(offsets), self.group, on_final)
        if not apply:
            self._update(packed)

    def _end_overlapped(self, flush: bool) -> None:
        """``overlap_sync``'s end of a window: the exchange in flight applied, δ = θ − s; δ's exchange starts
        in the worker and θ ← θ_sync + δ, s ← θ; a flush runs it now, s ← θ = θ_sync, and ends the thread."""
        assert self._start is not None and self._synced is not None
        steps, self.steps = self.steps, 0
        if steps == 0 and self._pending is None:
            return
        if self.outer_optimizer is None and not flush:
            packed = self._shift_window()
        else:
            if steps:
                for p, s in zip(self.params, self._start, strict=True):
                    torch.sub(p.detach(), s, out=s)
            self._wait()
            packed = self._pack(None) if steps else []
            if flush:
                self._combine_packed(packed, self.group)
                if packed:
                    self._update(packed)
                for p, s in zip(self.params, self._start, strict=True):
                    s.copy_(p.detach())
                self.close()
                return
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adasum-overlap-sync")
        self._pending = (self._worker.submit(self._combine_packed, packed, self.overlap_group), packed)
        if self.outer_optimizer is not None:
            for p, s in zip(self.params, self._start, strict=True):
                p.detach().add_(s)
                s.copy_(p.detach())

    def _shift_window(self) -> list[_Packed]:
        """The window end without an outer optimizer, in one pass per chunk of :data:`SHIFT_CHUNK` elements
        (each read from memory once): θ_sync += C (the exchange in flight, finished first), δ = θ − s into
        the send buffers, θ ← θ_sync + δ, s ← θ. Returns the send buffers."""
        assert self._start is not None and self._synced is not None
        applying = self._finish()
        packed = self._buffers()
        for i, out in _views(self.params, packed):
            for p, s, synced, sent in _chunks(self.params[i].detach(), self._start[i], self._synced[i], out):
                if applying:
                    synced.add_(sent)
                torch.sub(p, s, out=s)
                sent.copy_(s)
                torch.add(synced, s, out=p)
                s.copy_(p)
        return packed

    def _finish(self) -> bool:
        """Wait for the exchange in flight, if any (raising what it raised); True if there was one."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending[0].result()
        return pending is not None

    def _wait(self) -> None:
        """Finish and apply the exchange in flight; the parameters become θ_sync."""
        pending = self._pending
        if self._finish():
            self._update(pending[1])  # type: ignore[index]
        else:
            for p, s in zip(self.params, self._synced, strict=True):  # type: ignore[arg-type]
                p.detach().copy_(s)

    def _combine_packed(self, packed: list[_Packed], group: dist.ProcessGroup | None) -> None:
        """Every flat buffer of ``packed`` combined over ``group`` (the worker thread: ``overlap_group``)."""
        with torch.no_grad():
            for _, offsets, flat in packed:
                self._combine(flat, _counts(offsets), group)

    def _combine(
        self,
        flat: torch.Tensor,
        counts: list[int],
        group: dist.ProcessGroup | None,
        on_final: Callable[[int, int], None] | None = None,
    ) -> None:
        """Combine the ranks' pseudo-gradients in ``flat`` over ``group``, in place."""
        size = world_size(group)
        if size > 1 and self.combine == "adasum":
            adasum_allreduce_flat(flat, counts, group, self.timeout, on_final, self.wire_dtype)
            return
        if size > 1:
            mean_allreduce_flat(flat, group, self.wire_dtype)
        if on_final is not None:
            on_final(0, flat.numel())

    def _buffers(self) -> list[_Packed]:
        """Per dtype and device the parameters' indices, their offsets and one flat send buffer
        (``overlap_sync``: kept across windows; else a :func:`workspace`). Its dtype is the wire dtype where
        only the exchange and θ_sync read it (Adasum, no outer optimizer: no wire copy), else theirs."""
        adasum_only = self.combine == "adasum" and self.outer_optimizer is None
        wire_dtype = self.wire_dtype if adasum_only else None
        buckets: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i, p in enumerate(self.params):
            if p.numel():
                buckets.setdefault((p.dtype, p.device), []).append(i)
        packed = []
        for (dtype, device), indices in buckets.items():
            offsets = list(accumulate((self.params[i].numel() for i in indices), initial=0))
            send_dtype = wire_dtype or dtype
            if self._start is None:
                flat = workspace(offsets[-1], send_dtype, device, slot="periodic-delta")
            elif (dtype, device) not in self._send:
                flat = self._send[dtype, device] = torch.empty(offsets[-1], dtype=send_dtype, device=device)
            else:
                flat = self._send[dtype, device]
            packed.append((indices, offsets, flat))
        return packed

    def _pack(self, base: list[torch.Tensor] | None) -> list[_Packed]:
        """The pseudo-gradients θ − ``base`` (None: the window starts, holding δ) in :meth:`_buffers`."""
        packed = self._buffers()
        for i, out in _views(self.params, packed):
            if base is None:
                out.copy_(self._start[i])  # type: ignore[index]
            else:
                torch.sub(self.params[i].detach(), base[i], out=out)
        return packed

    def _update(self, packed: list[_Packed]) -> None:
        """θ_sync ← θ_sync + C, or the outer step with −C as the gradient; the parameters become θ_sync."""
        assert self._synced is not None
        saved_grads = [p.grad for p in self.params]
        for i, delta in _views(self.params, packed):
            p, s = self.params[i], self._synced[i]
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

    def close(self) -> None:
        """End the worker thread of ``overlap_sync``, after the exchange in flight (which is not applied)."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        self._pending = None

    def state_dict(self) -> dict[str, Any]:
        """The position in the window, θ_sync and the outer optimizer's state (with ``overlap_sync``, after
        :meth:`sync` on every rank)."""
        if self.overlap_sync:
            self.sync()
        return {
            "steps": self.steps,
            "synced": None if self._synced is None else [s.clone() for s in self._synced],
            "outer_optimizer": None if self.outer_optimizer is None else self.outer_optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values (not the parameters); an exchange in flight is dropped."""
        self.close()
        self.steps = int(state["steps"])
        if self._synced is not None and state["synced"] is not None:
            for copies in [self._synced] if self._start is None else [self._synced, self._start]:
                for s, saved in zip(copies, state["synced"], strict=True):
                    s.copy_(saved)
        if self.outer_optimizer is not None and state["outer_optimizer"] is not None:
            self.outer_optimizer.load_state_dict(state["outer_optimizer"])

    def _copy(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.params]


def periodic_sync(
    strategy: Any,
    optimizer: Optimizer,
    restored: dict[str, Any] | None,
    timeout: timedelta | None,
    overlap_group: dist.ProcessGroup | None,
) -> PeriodicSync:
    """``optimizer``'s windows under ``strategy``'s local-SGD options, restored from ``restored``. Raises
    ``AdasumConfigurationError``: on every rank, an outer optimizer over other parameters."""
    params = optimizer_parameters(optimizer)
    outer = None
    if strategy.outer_optimizer is not None:
        outer = strategy.outer_optimizer(params)
        with reported_on_every_rank(strategy.global_rank):
            check_outer_optimizer(
                strategy.strategy_name,
                [id(p) for p in params],
                [id(p) for p in optimizer_parameters(outer)],
                builder=True,
            )
    built = PeriodicSync(
        params,
        strategy.sync_every,
        strategy.combine,
        outer,
        timeout=timeout,
        wire_dtype=strategy.wire_dtype,
        overlap_sync=strategy.overlap_sync,
        overlap_group=overlap_group,
    )
    if restored is not None:
        built.load_state_dict(restored)
    return built


def close_windows(windows: dict[int, PeriodicSync]) -> None:
    """End the worker threads of ``windows`` (:meth:`PeriodicSync.close`) and forget them."""
    for built in windows.values():
        built.close()
    windows.clear()


#: One dtype and device's pseudo-gradients: (parameter indices, offsets in the buffer, the flat buffer).
_Packed = tuple[list[int], list[int], torch.Tensor]


def _views(params: list[torch.Tensor], packed: list[_Packed]) -> Iterator[tuple[int, torch.Tensor]]:
    """(index, the parameter's slice of the flat buffer in its shape) per parameter in ``packed``."""
    for indices, offsets, flat in packed:
        for i, at in zip(indices, offsets, strict=False):
            yield i, flat[at : at + params[i].numel()].view(params[i].shape)


def _chunks(*tensors: torch.Tensor) -> Iterator[tuple[torch.Tensor, ...]]:
    """Matching 1-D pieces of at most :data:`SHIFT_CHUNK` elements of same-shape ``tensors``, or the whole
    tensors where one is not contiguous."""
    if not all(t.is_contiguous() for t in tensors):
        yield tensors
        return
    flat = [t.view(-1) for t in tensors]
    n = flat[0].numel()
    for at in range(0, n, SHIFT_CHUNK):
        yield tuple(t[at : at + SHIFT_CHUNK] for t in flat)


def _counts(offsets: list[int]) -> list[int]:
    return [b - a for a, b in zip(offsets, offsets[1:], strict=False)]


def _apply_deltas(
    params: list[torch.Tensor],
    synced: list[torch.Tensor],
    offsets: list[int],
    flat: torch.Tensor,
    start: int,
    length: int,
) -> None:
    """θ := θ_sync + Δ, then θ_sync := θ, on the packed elements ``[start, start + length)`` (contiguous
    ``params``), range by range while the rest is in flight."""
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
