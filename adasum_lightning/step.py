"""The Adasum step, once for every training loop: capture, local step, deltas, Adasum, write back.

The Trainer's and Fabric's ``ddp_adasum`` and :class:`~adasum_lightning.AdasumOptimizer` update the
parameters through :func:`adasum_step`, differing only in their local step; :class:`BackwardAdasumStep`
gives the same parameters bucket by bucket during backward. Semantics (Horovod 0.28.1's
``_DistributedAdasumOptimizer``, ``horovod/torch/optimizer.py``): every rank steps its own optimizer from the
same θ, giving ``d_r = θ_r − θ``, then sets ``θ := θ + Adasum(d_0, …, d_{N−1})`` (Maleki et al., MLSys 2021).
The rules of the step's options are here too: ``compression`` and ``overlap_backward``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from adasum_lightning.allreduce import adasum_allreduce_flat, workspace
from adasum_lightning.errors import AdasumConfigurationError

__all__ = [
    "adasum_step",
    "BackwardAdasumStep",
    "PER_PARAMETER_OPTIMIZERS",
    "optimizer_parameters",
    "broadcast_from_rank_zero",
    "world_size",
    "WIRE_DTYPES",
    "check_wire_compression",
    "check_overlap_backward",
    "overlap_fallback_reason",
]

#: The ``torch.optim`` optimizers whose step updates each parameter from its own gradient and state alone, so
#: that stepping the parameters bucket by bucket gives the parameters of one whole step, bitwise.
PER_PARAMETER_OPTIMIZERS: tuple[type[Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
)

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


#: ``compression`` of ``ddp_adasum``, ``fsdp_adasum`` and ``AdasumOptimizer``: the dtype of every sent piece.
WIRE_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_wire_compression(compression: object, owner: str) -> torch.dtype | None:
    """``compression``: None (off), ``"bf16"`` or ``"fp16"``; returns the wire dtype (None: off).

    Raises:
        AdasumConfigurationError: any other value; the message names the accepted ones.
    """
    if compression not in (None, *WIRE_DTYPES):
        raise AdasumConfigurationError(
            f"{owner}'s compression is None (off), 'bf16' or 'fp16' (every piece the combination sends "
            f"rounded to bfloat16 or float16), got {compression!r}"
        )
    return None if compression is None else WIRE_DTYPES[compression]


def adasum_step(
    params: Sequence[torch.Tensor],
    local_step: Callable[[], T],
    group: dist.ProcessGroup | None = None,
    timeout: timedelta | None = None,
    wire_dtype: torch.dtype | None = None,
) -> T:
    """Run ``local_step`` (this rank's optimizer step), then replace its update of ``params`` by the Adasum of
    every rank's update: ``θ := θ_before + Adasum(θ_after − θ_before over the ranks)``.

    Every rank of ``group`` calls this for the same ``params`` at the same step; a rank whose local step
    changes nothing (a skipped step, no gradient) contributes a zero delta, which Adasum leaves out. The
    local step runs on a flat copy of ``params`` per dtype and device (kept between steps, per thread), so the
    parameters' own storage keeps ``θ_before``; the deltas are reduced in that copy in place. The arithmetic
    is the plain step's, so the parameters are the same bitwise. Memory: one flat copy of ``params`` and the
    reduction's receive buffer.

    Args:
        params: the parameters the local step may change (floating-point; any layout).
        local_step: runs the local step; its return value is returned.
        group: the process group (default: the default group); at world size 1, ``local_step()`` alone.
        timeout: how long one exchange waits for a peer (see :func:`adasum_lightning.adasum_allreduce`).
        wire_dtype: None, or the dtype every sent piece is rounded to (see
            :func:`adasum_lightning.allreduce.adasum_allreduce_flat`).

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
    with contextlib.ExitStack() as stack:
        swapped = []
        for (dtype, device), bucket in buckets.items():
            work = workspace(sum(p.numel() for p in bucket), dtype, device, "step-work")
            pieces = _views(work, bucket)
            own = stack.enter_context(_stepping_on_copy(bucket, work, pieces))
            swapped.append((bucket, own, pieces, work))
        output = local_step()
    with torch.no_grad():
        for bucket, own, pieces, work in swapped:
            for start, piece in zip(own, pieces, strict=True):
                torch.sub(piece, start, out=piece)  # θ_after − θ_before
            counts = [p.numel() for p in bucket]
            adasum_allreduce_flat(work, counts, group, timeout, wire_dtype=wire_dtype)
            for start, piece in zip(own, pieces, strict=True):
                torch.add(start, piece, out=start)
    return output


def check_overlap_backward(overlap_backward: object, bucket_cap_mb: object, strategy_name: str) -> None:
    """``overlap_backward`` is a bool and ``bucket_cap_mb`` a positive number of MiB.

    Raises:
        ValueError: either is off; the message names the accepted values.
    """
    if not isinstance(overlap_backward, bool):
        raise ValueError(
            f"{strategy_name}'s overlap_backward is True (step and reduce bucket by bucket during the "
            f"backward pass) or False (the whole step after it), got {overlap_backward!r}"
        )
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, int | float) or not bucket_cap_mb > 0:
        raise ValueError(
            f"{strategy_name}'s bucket_cap_mb is the bucket size in MiB, a positive number such as 25 (DDP's "
            f"default), got {bucket_cap_mb!r}"
        )


def overlap_fallback_reason(
    *,
    automatic_optimization: bool,
    optimizer: str,
    per_parameter: bool,
    gradient_clipping: str | None,
    gradient_scaler: bool,
    precision_plugin: str | None,
    before_step_hooks: Sequence[str],
) -> str | None:
    """Why ``overlap_backward=True`` must take the whole step after backward, or None when it need not.

    Args:
        automatic_optimization: the LightningModule's ``automatic_optimization``.
        optimizer: the optimizer's class name.
        per_parameter: whether it is one of :data:`adasum_lightning.step.PER_PARAMETER_OPTIMIZERS`.
        gradient_clipping: how gradients are clipped (e.g. ``"gradient_clip_val=1.0"``); None: not clipped.
        gradient_scaler: fp16 mixed precision's ``GradScaler`` is in use.
        precision_plugin: the precision plugin's class name when it runs the step its own way, else None.
        before_step_hooks: overrides between backward and the step, as ``Class.hook``.
    """
    if not automatic_optimization:
        return "manual optimization calls backward and step itself"
    if not per_parameter:
        return (
            f"{optimizer} is not one of the per-parameter torch.optim optimizers (SGD, Adam, AdamW, Adagrad, "
            "Adamax, NAdam, RAdam, RMSprop)"
        )
    if gradient_clipping is not None:
        return f"gradient clipping ({gradient_clipping}) needs every gradient before the first bucket steps"
    if gradient_scaler:
        return "fp16 mixed precision's GradScaler checks every gradient before the step (bf16 has no scaler)"
    if precision_plugin is not None:
        return f"the precision plugin {precision_plugin} runs the optimizer step its own way"
    if before_step_hooks:
        hooks = ", ".join(before_step_hooks)
        return f"{hooks} run between backward and the step (they may change gradients or read parameters)"
    return None


class _Bucket:
    """Parameters of one dtype and device, stepped and reduced together (buffer kept between steps)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.work = torch.empty(
            sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device
        )
        self.counts = [p.numel() for p in params]
        self.pieces = _views(self.work, params)
        self.own: list[torch.Tensor] = []  # the parameters' own storage (θ_before) while in flight
        self.ids = {id(p) for p in params}
        self.arrived = 0  # gradients accumulated in this step
        self.ready = threading.Event()  # the deltas are in ``work``: the worker may reduce them
        self.done = threading.Event()  # ``θ_before + Adasum`` is written back


class BackwardAdasumStep:
    """:func:`adasum_step` bucket by bucket during ``loss.backward()``, as Horovod's Adasum optimizer steps
    parameter by parameter (``_DistributedAdasumOptimizer``, ``horovod/torch/optimizer.py``).

    The trainable parameters, in reverse order, are cut into buckets of one dtype and device of at least
    ``bucket_bytes`` (as DDP's). While :attr:`armed`, a bucket whose gradients are all accumulated steps alone
    on its flat copy and a worker thread reduces the buckets in bucket order on ``group`` while backward goes
    on; :meth:`finish` steps the buckets backward left incomplete and waits. The parameters of
    :func:`adasum_step` bitwise, for a per-parameter optimizer (:data:`PER_PARAMETER_OPTIMIZERS`) without a
    closure and with gradients unchanged between backward and the step. At construction every rank takes
    the first rank's parameter values.

    Args:
        optimizer: the local optimizer (not wrapped by :class:`~adasum_lightning.AdasumOptimizer`).
        group: the process group of the reduction; the worker thread is its only user (e.g.
            ``dist.new_group(backend=dist.get_backend())``, built on every rank).
        bucket_bytes: a bucket is closed once it holds this many bytes or more.
        timeout: how long one exchange waits for a peer (see :func:`adasum_lightning.adasum_allreduce`).
        wire_dtype: as for :func:`adasum_step`.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        group: dist.ProcessGroup,
        bucket_bytes: int = 25 << 20,
        timeout: timedelta | None = None,
        wire_dtype: torch.dtype | None = None,
    ) -> None:
        self.optimizer, self.group, self.timeout, self.wire_dtype = optimizer, group, timeout, wire_dtype
        #: While True, a completed bucket steps and is reduced; backward passes outside a step (a gradient
        #: accumulation window, manual backward) leave the parameters alone.
        self.armed = True
        trainable = [p for p in optimizer_parameters(optimizer) if p.requires_grad and p.numel()][::-1]
        self.buckets: list[_Bucket] = []
        current: list[torch.Tensor] = []
        size = 0
        for p in trainable:
            if current and (p.dtype, p.device) != (current[0].dtype, current[0].device):
                self.buckets.append(_Bucket(current))
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_bytes:
                self.buckets.append(_Bucket(current))
                current, size = [], 0
        if current:
            self.buckets.append(_Bucket(current))
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._trainable = self._trainable_ids()
        broadcast_from_rank_zero(optimizer_parameters(optimizer), group)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_gradient) for p in trainable]
        self._error: BaseException | None = None
        self._closed = False
        self._in_step = False  # from the first bucket stepped until finish() has seen them all written
        self._worker = threading.Thread(target=self._reduce_in_order, name="adasum-backward", daemon=True)
        self._worker.start()

    def finish(self) -> None:
        """Step the buckets backward left incomplete, then wait until every bucket is reduced and written.

        Raises:
            RuntimeError: from ``torch.distributed`` in the worker (a peer lost, a timeout); or, after the
                step, when the optimizer's trainable parameters are no longer those the buckets were built
                for (the message names the fix).
        """
        for bucket in self.buckets:
            if bucket.arrived < len(bucket.params):
                self._step(bucket)
        for bucket in self.buckets:
            bucket.done.wait()
            bucket.done.clear()
            bucket.arrived = 0
        self._in_step = False
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        if not self.is_current():
            raise RuntimeError(
                "the optimizer's trainable parameters changed (requires_grad set or cleared, or a param "
                "group added) since this BackwardAdasumStep was built, so its buckets miss or hold the wrong "
                "ones: close() it and build a new one after such a change (every rank at the same step)."
            )

    def is_current(self) -> bool:
        """True while the optimizer's trainable parameters are those the buckets were built for."""
        return self._trainable_ids() == self._trainable

    def _trainable_ids(self) -> list[int]:
        return [id(p) for p in optimizer_parameters(self.optimizer) if p.requires_grad and p.numel()]

    def close(self) -> None:
        """Remove the gradient hooks and stop the worker thread (the buffers go with the object). After a step
        that failed half way the worker may be waiting for a peer: it is left to end with its timeout."""
        for handle in self._hooks:
            handle.remove()
        self._closed = True
        for bucket in self.buckets:
            bucket.ready.set()
        if not self._in_step:
            self._worker.join()

    def _on_gradient(self, param: torch.Tensor) -> None:
        if not self.armed:
            return
        bucket = self._bucket_of[id(param)]
        bucket.arrived += 1
        if bucket.arrived == len(bucket.params):
            self._step(bucket)

    @torch.no_grad()
    def _step(self, bucket: _Bucket) -> None:
        self._in_step = True
        groups = self.optimizer.param_groups
        kept = [g["params"] for g in groups]
        for g in groups:
            g["params"] = [p for p in g["params"] if id(p) in bucket.ids]
        try:
            with _stepping_on_copy(bucket.params, bucket.work, bucket.pieces) as bucket.own:
                self.optimizer.step()
        finally:
            for g, params in zip(groups, kept, strict=True):
                g["params"] = params
        for start, piece in zip(bucket.own, bucket.pieces, strict=True):
            torch.sub(piece, start, out=piece)  # θ_after − θ_before
        bucket.arrived = len(bucket.params)
        bucket.ready.set()

    @torch.no_grad()
    def _reduce_in_order(self) -> None:
        while self.buckets:
            for bucket in self.buckets:
                bucket.ready.wait()
                bucket.ready.clear()
                if self._closed:
                    return
                try:
                    if self._error is None:  # after a failed exchange the peers are not in step any more
                        adasum_allreduce_flat(
                            bucket.work, bucket.counts, self.group, self.timeout, wire_dtype=self.wire_dtype
                        )
                        for start, piece in zip(bucket.own, bucket.pieces, strict=True):
                            torch.add(start, piece, out=start)
                except BaseException as error:  # noqa: BLE001  (raised again by finish() in the main thread)
                    self._error = error
                bucket.done.set()


@contextlib.contextmanager
def _stepping_on_copy(
    params: list[torch.Tensor], work: torch.Tensor, pieces: list[torch.Tensor]
) -> Iterator[list[torch.Tensor]]:
    """Copy ``params`` into the flat buffer ``work`` and, inside the block, make each parameter's ``.data``
    its piece of it (``pieces``: ``work`` cut like ``params``); yields the parameters' own storage, which
    keeps the values from before the block. On leaving (also by an exception) the parameters get their own
    storage back; ``work`` then holds the values the block left."""
    with torch.no_grad():
        torch.cat([p.detach().reshape(-1) for p in params], out=work)
    own = [p.data for p in params]
    try:
        for p, piece in zip(params, pieces, strict=True):
            p.data = piece
        yield own
    finally:
        for p, start in zip(params, own, strict=True):
            p.data = start


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
