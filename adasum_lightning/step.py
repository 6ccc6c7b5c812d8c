"""The Adasum step, once for every training loop: every rank steps from the same θ, then
``θ := θ + Adasum(θ_r − θ)`` (Horovod 0.28.1's ``_DistributedAdasumOptimizer``).
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

from adasum_lightning.allreduce import adasum_allreduce_flat, buckets, workspace
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

#: ``torch.optim`` optimizers that update each parameter from its own gradient and state alone.
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
    """Every parameter of ``optimizer``'s param groups, in order, each once (frozen ones included)."""
    seen: dict[int, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            seen.setdefault(id(p), p)
    return list(seen.values())


#: ``compression`` of ``ddp_adasum``, ``fsdp_adasum`` and ``AdasumOptimizer``: the dtype of every sent piece.
WIRE_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_wire_compression(compression: object, owner: str) -> torch.dtype | None:
    """The wire dtype of ``compression`` (None, ``"bf16"`` or ``"fp16"``). Raises
    ``AdasumConfigurationError``: any other value."""
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
    """Run ``local_step`` (this rank's optimizer step), then ``θ := θ_before + Adasum(θ_after − θ_before)``.

    Every rank of ``group`` calls this for the same ``params`` at the same step (a rank that changes nothing
    contributes a zero delta). The local step runs on a flat copy of ``params`` per dtype and device, kept per
    thread, so the parameters' own storage keeps θ_before. At world size 1: ``local_step()`` alone.
    ``timeout``, ``wire_dtype`` and the errors raised: as for :func:`~adasum_lightning.adasum_allreduce`.
    """
    if world_size(group) == 1:
        return local_step()
    with contextlib.ExitStack() as stack:
        swapped = []
        for (dtype, device), bucket in buckets([p for p in params if p.numel()]).items():
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
    """Raises ValueError unless ``overlap_backward`` is a bool and ``bucket_cap_mb`` a positive number."""
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

    ``gradient_clipping`` (e.g. ``"gradient_clip_val=1.0"``) and ``precision_plugin`` (a class name) are None
    when unused; ``before_step_hooks``: overrides between backward and the step, as ``Class.hook``.
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
        self.counts = [p.numel() for p in params]
        self.work = torch.empty(sum(self.counts), dtype=params[0].dtype, device=params[0].device)
        self.pieces = _views(self.work, params)
        self.own: list[torch.Tensor] = []  # the parameters' own storage (θ_before) while in flight
        self.ids = {id(p) for p in params}
        self.arrived = 0  # gradients accumulated in this step
        self.ready = threading.Event()  # the deltas are in ``work``: the worker may reduce them
        self.done = threading.Event()  # ``θ_before + Adasum`` is written back


class BackwardAdasumStep:
    """:func:`adasum_step` bucket by bucket during ``loss.backward()``, as Horovod's Adasum optimizer.

    The trainable parameters, in reverse order, form buckets of one dtype and device of at least
    ``bucket_bytes``. While :attr:`armed`, a bucket whose gradients have all arrived steps on its flat copy
    and a worker thread reduces it on ``group`` (its only user); :meth:`finish` steps the rest and waits.
    Bitwise :func:`adasum_step` for :data:`PER_PARAMETER_OPTIMIZERS`. At construction every rank takes rank
    0's parameters.
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
        #: While True, a completed bucket steps (False: accumulation or manual backward passes).
        self.armed = True
        trainable = [p for p in optimizer_parameters(optimizer) if p.requires_grad and p.numel()][::-1]
        cut: list[list[torch.Tensor]] = []
        size, key = 0, None
        for p in trainable:  # a new bucket once full, or at another dtype or device
            if size >= bucket_bytes or (p.dtype, p.device) != key:
                cut.append([])
                size, key = 0, (p.dtype, p.device)
            cut[-1].append(p)
            size += p.numel() * p.element_size()
        self.buckets = [_Bucket(params) for params in cut]
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
        Raises ``RuntimeError``: from ``torch.distributed`` in the worker; or the trainable parameters
        changed."""
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
        """Remove the gradient hooks and stop the worker thread (left to its timeout after a failed step)."""
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
    """Inside the block each parameter's ``.data`` is its piece of ``work`` (a copy of ``params``); yields the
    parameters' own storage (the values before), given back on leaving."""
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
    """Give every rank of ``group`` its first rank's values, in place (``bool`` as ``uint8`` for Gloo)."""
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
