"""Adasum across replica groups, FSDP2 sharding inside each group (``torch`` only).

Horovod 0.28.1's hierarchical Adasum (``adasum_gpu_operations.cc``) with a replica group of the 2-D mesh
(:mod:`adasum_lightning.mesh`) in place of a node: FSDP2 steps each group's shards, then the groups' deltas
are combined per whole parameter (statistics summed in float64 over the shard group) in
:func:`~adasum_lightning.adasum_allreduce`'s pairing; both partners compute the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from itertools import accumulate
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.nn import Module
from torch.optim import Optimizer

from adasum_lightning import allreduce
from adasum_lightning.allreduce import (
    CPU_CHUNK,
    DEVICE_CHUNK,
    Communicator,
    Pieces,
    buckets,
    check_tensor,
    coefficients,
    communicator,
    local_grams,
    plan_chunks,
    scaled_add,
    workspace,
)
from adasum_lightning.errors import AdasumConfigurationError
from adasum_lightning.step import world_size

__all__ = [
    "check_sharded_parameters",
    "check_optimizer_of_sharded_module",
    "sharded_adasum_step",
    "local_shards",
    "full_tensor",
    "local_chunk",
    "shard_module",
    "full_state_dict",
    "load_full_state_dict",
    "optimizer_state_to_local",
    "optimizer_state_to_shards",
]

T = TypeVar("T")


def check_sharded_parameters(owner: str, shard_size: int, unsharded: Sequence[str]) -> None:
    """Refuse the parameters described in ``unsharded`` (not FSDP2 ``Shard`` DTensors on ``mesh["shard"]``).
    Raises ``AdasumConfigurationError``: naming up to three of them and the fix."""
    if not unsharded:
        return
    shown = "; ".join(unsharded[:3]) + (f"; and {len(unsharded) - 3} more" if len(unsharded) > 3 else "")
    raise AdasumConfigurationError(
        f"{owner}: {len(unsharded)} parameter(s) are not sharded over the mesh's 'shard' dimension "
        f"(size {shard_size}): {shown}. Apply fully_shard(block, mesh=mesh['shard']) to each block and then "
        "to the root module before building the optimizer (not on the 2-D mesh: that would average the "
        "gradients across the replica groups, which Adasum combines instead)."
    )


def check_optimizer_of_sharded_module(
    strategy_name: str, stale: int, total: int, has_state: bool = False
) -> None:
    """Refuse an optimizer holding ``stale`` of its ``total`` parameters from before ``fully_shard`` replaced
    them, or (``has_state``) one that stepped before (it cannot be rebound). Raises
    ``AdasumConfigurationError``: naming the order of calls that works."""
    if not stale and not has_state:
        return
    what = (
        "has optimizer state already (it stepped before the model was sharded)"
        if has_state
        else f"holds {stale} of its {total} parameter(s) from before the model was sharded (fully_shard "
        "replaces every parameter)"
    )
    raise AdasumConfigurationError(
        f"{strategy_name}: the optimizer {what}. Set the model up first, then build the optimizer from its "
        "parameters: model = fabric.setup_module(model); optimizer = fabric.setup_optimizers("
        "torch.optim.SGD(model.parameters(), ...)) — or pass a fresh optimizer with the model: "
        "model, optimizer = fabric.setup(model, optimizer)."
    )


def local_shards(
    params: Sequence[torch.Tensor], shard_group: dist.ProcessGroup, owner: str = "sharded_adasum_step"
) -> list[torch.Tensor]:
    """Each parameter's local shard (``to_local()``: a view of its storage); a plain tensor itself. Raises
    ``AdasumConfigurationError``: with a shard group of several ranks, a parameter not sharded over it."""
    size = world_size(shard_group)
    ranks = dist.get_process_group_ranks(shard_group) if size > 1 else []
    out, unsharded = [], []
    for i, p in enumerate(params):
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            sharded = all(isinstance(pl, Shard) for pl in p.placements)
            if mesh.ndim != 1 or not sharded or (size > 1 and mesh.mesh.flatten().tolist() != ranks):
                unsharded.append(f"#{i} {tuple(p.shape)} {tuple(p.placements)} on {mesh}")
            with torch.no_grad():
                out.append(p.to_local())
        else:
            if size > 1:
                unsharded.append(f"#{i} {tuple(p.shape)} a plain {type(p).__name__}")
            out.append(p)
    check_sharded_parameters(owner, size, unsharded)
    return out


def full_tensor(t: torch.Tensor, shard_group: dist.ProcessGroup) -> torch.Tensor:
    """A new whole tensor of a ``DTensor`` sharded over ``shard_group`` (a collective on it); a plain tensor
    cloned.

    ``all_gather`` of the padded shards, not ``DTensor.full_tensor()``: its plans are cached by mesh layout
    and would name the groups of a destroyed, equal mesh.
    """
    if not isinstance(t, DTensor):
        return t.detach().clone()
    local = t.to_local().detach()
    size = world_size(shard_group)
    if size == 1:
        return local.clone()
    dim, n, chunk = _chunking(t, size)
    padded = local.new_zeros((*local.shape[:dim], chunk, *local.shape[dim + 1 :]))
    padded.narrow(dim, 0, local.shape[dim]).copy_(local)
    parts = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(parts, padded.contiguous(), group=shard_group)
    return torch.cat(parts, dim=dim).narrow(dim, 0, n).clone()


def local_chunk(whole: torch.Tensor, param: torch.Tensor, shard_group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's chunk of ``whole`` as FSDP2 cuts ``param`` (``ceil(n / S)`` along the ``Shard`` dim), a
    view; ``whole`` itself for a plain ``param``. Raises ``ValueError``: ``whole`` does not have ``param``'s
    global shape."""
    if tuple(whole.shape) != tuple(param.shape):
        raise ValueError(
            f"a saved tensor of shape {tuple(whole.shape)} cannot fill a parameter of shape "
            f"{tuple(param.shape)}: load a checkpoint of this model"
        )
    if not isinstance(param, DTensor):
        return whole
    size = world_size(shard_group)
    dim, n, chunk = _chunking(param, size)
    start = min(chunk * (dist.get_rank(shard_group) if size > 1 else 0), n)
    return whole.narrow(dim, start, param.to_local().shape[dim])


def _chunking(t: DTensor, size: int) -> tuple[int, int, int]:
    """FSDP2's ``Shard(dim)`` of ``t`` over ``size`` ranks: ``(dim, length, chunk)``, chunks of ``ceil``."""
    placement = t.placements[0]
    assert isinstance(placement, Shard), placement
    n = t.shape[placement.dim]
    return placement.dim, n, -(-n // size)


def shard_module(
    module: Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None = None
) -> list[str]:
    """``fully_shard`` over the 1-D ``mesh`` on each top-level child with parameters, then on ``module``;
    a module the user sharded already is sharded at the root only. Returns the names sharded (``""``: root).
    """
    kwargs: dict[str, Any] = {"mesh": mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    sharded = []
    if not any(isinstance(m, FSDPModule) for m in module.modules()):
        for name, child in module.named_children():
            if any(True for _ in child.parameters()):
                fully_shard(child, **kwargs)
                sharded.append(name)
    if not isinstance(module, FSDPModule):
        fully_shard(module, **kwargs)
        sharded.append("")
    return sharded


def full_state_dict(module: Module, shard_group: dist.ProcessGroup | None) -> dict[str, Any]:
    """``module.state_dict()`` with each sharded tensor gathered whole (a collective on ``shard_group``)."""
    state = module.state_dict()
    if shard_group is None:
        return state
    return {k: full_tensor(v, shard_group) if isinstance(v, DTensor) else v for k, v in state.items()}


def load_full_state_dict(
    module: Module, state_dict: Mapping[str, Any], shard_group: dist.ProcessGroup, strict: bool = True
) -> tuple[list[str], list[str]]:
    """Fill a sharded module from whole tensors, each rank its own chunk; returns ``(missing, unexpected)``.
    Raises ``RuntimeError``: with ``strict``, keys missing or unexpected (as ``Module.load_state_dict``).
    ValueError: a saved tensor of another shape."""
    own = module.state_dict(keep_vars=True)
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(module).__name__}: missing keys {missing}, unexpected "
            f"keys {unexpected}. Load a checkpoint of this model, or pass strict=False."
        )
    with torch.no_grad():
        for key, target in own.items():
            if key not in state_dict or not torch.is_tensor(target):
                continue
            value = torch.as_tensor(state_dict[key])
            local = target.to_local() if isinstance(target, DTensor) else target
            local.copy_(local_chunk(value, target, shard_group))
    return missing, unexpected


def optimizer_state_to_local(state_dict: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's ``state_dict()`` with its ``DTensor`` values as copies of the local shards."""
    return {
        **state_dict,
        "state": {
            key: {k: v.to_local().clone() if isinstance(v, DTensor) else v for k, v in values.items()}
            for key, values in state_dict.get("state", {}).items()
        },
    }


def optimizer_state_to_shards(optimizer: Optimizer, shard_group: dist.ProcessGroup, whole: bool) -> None:
    """Turn the loaded state tensors (dim ≥ 1) of ``DTensor`` parameters into shards like them, in place: this
    rank's chunk with ``whole`` (saved unsharded), else the tensor itself."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, DTensor) or p not in optimizer.state:
                continue
            values = optimizer.state[p]
            for k, v in values.items():
                if torch.is_tensor(v) and not isinstance(v, DTensor) and v.dim() > 0:
                    local = p.to_local()
                    chunk = local_chunk(v, p, shard_group) if whole else v
                    chunk = chunk.to(device=local.device, dtype=local.dtype).contiguous()
                    values[k] = DTensor.from_local(
                        chunk, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                    )


def sharded_adasum_step(
    params: Sequence[torch.Tensor],
    local_step: Callable[[], T],
    replicate_group: dist.ProcessGroup,
    shard_group: dist.ProcessGroup,
    timeout: timedelta | None = None,
    wire_dtype: torch.dtype | None = None,
) -> T:
    """Run ``local_step`` (this replica group's sharded step), then ``θ := θ_before + Adasum(θ_after −
    θ_before)`` across the replica groups, per whole parameter.

    θ_before is kept as one flat shard-sized buffer per dtype and device; the partner's deltas are received
    into the sharded gradients (a scratch buffer for parameters without a usable one), so **after the step
    the gradients of ``params`` are None**. With one replica group: ``local_step()`` alone. ``wire_dtype``
    and the errors raised: as for :func:`~adasum_lightning.adasum_allreduce`; AdasumConfigurationError for a
    parameter not sharded over ``shard_group``.
    """
    if world_size(replicate_group) == 1:
        return local_step()
    params = [p for p in params if p.numel()]  # the whole tensor's size: the same on every rank
    shards = local_shards(params, shard_group)
    for i, t in enumerate(shards):
        check_tensor(t, i)
    befores = {}
    with torch.no_grad():
        for key, bucket in buckets(shards).items():
            before = workspace(sum(t.numel() for t in bucket), *key, slot=_STEP_SLOTS[0])
            torch.cat([t.reshape(-1) for t in bucket], out=before)
            befores[key] = before
    output = local_step()
    with torch.no_grad():
        shards = local_shards(params, shard_group)  # the same views, looked up again after the step
        receive = _gradient_buffers(params, shards)
        comm = communicator(replicate_group, timeout)
        by_key: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i, t in enumerate(shards):
            by_key.setdefault((t.dtype, t.device), []).append(i)
        for key, ids in by_key.items():
            bucket, grads = [shards[i] for i in ids], [receive[i] for i in ids]
            _step_bucket(bucket, grads, befores[key], comm, shard_group, wire_dtype)
        for p in params:
            p.grad = None  # the partner's deltas are in them now: released, as zero_grad(set_to_none=True)
    return output


#: The workspace slots :func:`sharded_adasum_step` keeps: θ_before, and the scratch for missing gradients.
_STEP_SLOTS: tuple[str, ...] = ("sharded-before", "sharded-scratch")


def _step_buffer_bytes() -> int:
    """The bytes of this thread's :data:`_STEP_SLOTS` buffers, every dtype and device."""
    return allreduce.workspace_bytes(_STEP_SLOTS)


def _gradient_buffers(
    params: Sequence[torch.Tensor], shards: Sequence[torch.Tensor]
) -> list[torch.Tensor | None]:
    """Per parameter, its gradient's local tensor where it can receive the partner's deltas (contiguous, the
    shard's shape, dtype and device, not aliased by tied parameters); else None."""
    out: list[torch.Tensor | None] = []
    seen: set[int] = set()
    for p, t in zip(params, shards, strict=True):
        g = p.grad
        if isinstance(g, DTensor):
            g = g.to_local()
        usable = (
            g is not None
            and g.shape == t.shape
            and g.dtype == t.dtype
            and g.device == t.device
            and g.is_contiguous()
            and (t.numel() == 0 or (g.data_ptr() not in seen and g.data_ptr() != t.data_ptr()))
        )
        if usable:
            seen.add(g.data_ptr())
        out.append(g.detach() if usable else None)
    return out


def _step_bucket(
    shards: list[torch.Tensor],
    grads: list[torch.Tensor | None],
    before: torch.Tensor,
    comm: Communicator,
    shard_group: dist.ProcessGroup,
    wire_dtype: torch.dtype | None = None,
) -> None:
    """One dtype and device after the local step: shards become deltas in place (non-contiguous ones in
    scratch), combined across replica groups (received into ``grads`` or scratch), θ_before added back."""
    counts = [t.numel() for t in shards]
    scratch_numel = sum(
        n * ((not t.is_contiguous()) + (g is None)) for t, g, n in zip(shards, grads, counts, strict=True)
    )
    scratch = before[:0]
    if scratch_numel:
        scratch = workspace(scratch_numel, before.dtype, before.device, slot=_STEP_SLOTS[1])
    own: list[torch.Tensor] = []
    recv: list[torch.Tensor] = []
    offset = used = 0
    for t, g, n in zip(shards, grads, counts, strict=True):
        b = before[offset : offset + n].view(t.shape)
        offset += n
        if t.is_contiguous():
            own.append(t.sub_(b).view(-1))
        else:
            own.append(torch.sub(t, b, out=scratch[used : used + n].view(t.shape)).view(-1))
            used += n
        if g is not None:
            recv.append(g.view(-1))
        else:
            recv.append(scratch[used : used + n])
            used += n
    if wire_dtype in (None, before.dtype):
        _reduce_lists(own, recv, counts, comm, shard_group)
    else:
        wire = workspace(sum(counts), wire_dtype, before.device, slot="wire")
        wire_recv = workspace(sum(counts), wire_dtype, before.device, slot="wire-recv")
        torch.cat(own, out=wire)
        wired = list(wire.split(counts))
        _reduce_lists(wired, list(wire_recv.split(counts)), counts, comm, shard_group)
        for o, w in zip(own, wired, strict=True):
            o.copy_(w)
    offset = 0
    for t, o, n in zip(shards, own, counts, strict=True):
        if not t.is_contiguous():  # its delta was combined in the scratch slot
            t.copy_(o.view(t.shape))
        t.add_(before[offset : offset + n].view(t.shape))  # θ_before + combined, as adasum_step
        offset += n


def _reduce_lists(
    own: list[torch.Tensor],
    recv: list[torch.Tensor],
    counts: list[int],
    comm: Communicator,
    shard_group: dist.ProcessGroup,
) -> None:
    """Adasum over the replica groups (``comm``) of the 1-D deltas ``own``, in place (``recv``: theirs)."""
    q, size = comm.rank, comm.size
    p = 1 << (size.bit_length() - 1)  # largest power of 2 <= size
    if q >= p:  # folded into q - p; the result comes back at the end
        comm.exchange(q - p, own, None)
        comm.exchange(q - p, None, own)
        return
    plan = plan_chunks(counts, CPU_CHUNK if own[0].device.type == "cpu" else DEVICE_CHUNK)
    pieces = _plan_pieces(plan, counts)
    if q + p < size:
        comm.exchange(q + p, None, recv)
        _combine_lists(own, recv, True, plan, pieces, shard_group)
    d = 1
    while d < p:
        comm.exchange(q ^ d, own, recv)
        _combine_lists(own, recv, q < q ^ d, plan, pieces, shard_group)
        d <<= 1
    if q + p < size:
        comm.exchange(q + p, own, None)


def _plan_pieces(plan: list, counts: list[int]) -> Pieces:
    """Per chunk of ``plan``, its parts ``(tensor index, start in tensor, start in chunk, length)``."""
    offsets = list(accumulate(counts, initial=0))
    out = []
    for s, _, ids, lengths in plan:
        parts, at = [], s
        for i, n in zip(ids, lengths, strict=True):
            parts.append((i, at - offsets[i], at - s, n))
            at += n
        out.append(parts)
    return out


def _combine_lists(
    own: list[torch.Tensor],
    theirs: list[torch.Tensor],
    own_is_low: bool,
    plan: list,
    pieces: Pieces,
    shard_group: dist.ProcessGroup,
) -> None:
    """``own := adasum(low, up)`` per whole tensor, ``low`` the lower replica index's shards; the statistics
    ``[low·up, ‖low‖², ‖up‖²]`` summed over ``shard_group``, the same operations on both partners."""
    low, up = (own, theirs) if own_is_low else (theirs, own)
    grams = local_grams(low, up, plan, pieces, len(own))
    stats = grams[:, [1, 0, 3]].contiguous()
    if world_size(shard_group) > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=shard_group)
    scaled_add(low, up, own, plan, pieces, coefficients(stats, left=True))
