"""Adasum across replica groups, FSDP2 sharding inside each group (``torch`` only).

The world is a 2-D device mesh ``replicate × shard`` of ``R`` replica groups of ``S`` ranks
(:mod:`adasum_lightning.mesh`). Inside a group FSDP2 works as usual (``fully_shard`` on the 1-D
``mesh["shard"]``): the gradients are reduce-scattered and averaged over the group and each rank steps its
own shard with its own shard of the optimizer state. Across the groups nothing is all-reduced; instead the
groups' parameter deltas ``θ_after − θ_before`` of the local step are combined by Adasum (Maleki et al.,
"Scaling Distributed Training with Adaptive Summation", MLSys 2021), per parameter as a whole tensor: its dot
products and squared norms are summed (float64) over the shard group. This is Horovod 0.28.1's hierarchical
Adasum (``horovod/common/ops/adasum_gpu_operations.cc``, ``NcclHierarchical``: reduce-scatter inside a node,
Adasum across nodes) with a replica group of ranks in place of a node, and FSDP2's sharded step in place of
the reduce-scatter. Each replica group keeps its own optimizer state; all groups hold the same parameters.

Pairing (that of :func:`adasum_lightning.allreduce.adasum_allreduce` and :func:`adasum_lightning.reference.
adasum_reduce`, over replica indices): for ``R = 2**k`` recursive doubling, group ``q`` with ``q XOR d`` at
``d = 1, 2, 4, …`` (neighbours first); otherwise, with ``P`` the largest power of 2 ≤ ``R``, groups
``q ≥ P`` are first folded into ``q − P``, then groups ``0 … P−1`` are reduced, then the result is sent back
to groups ``q ≥ P``. Every exchange moves whole local shards (rank ``(q, j)`` with rank ``(q', j)``, on the
replicate group); both partners compute the combination from the same operands in the same order (the lower
replica index's first), so the replicas stay bitwise identical.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
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
    Pieces,
    _check_tensor,
    _coefficients,
    _Comm,
    _local_grams,
    _plan,
    _scaled_add,
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
    """Every parameter is sharded by FSDP2 over the shard group (a ``DTensor`` with ``Shard`` placements on
    the 1-D mesh ``mesh["shard"]``); with ``shard_size`` 1 plain tensors are whole tensors and fine.
    ``unsharded``: a description of each parameter that is not.

    Raises:
        AdasumConfigurationError: naming up to three such parameters and the fix.
    """
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
    """An optimizer set up under an FSDP2 strategy steps the sharded module's parameters: ``fully_shard``
    replaces each parameter by a new (sharded) one, so an optimizer built before the module was set up holds
    ``stale`` of its ``total`` parameters that no longer train. ``fabric.setup(model, optimizer)`` rebinds an
    optimizer that has no state yet; ``has_state``: one that has stepped already (it cannot be rebound).

    Raises:
        AdasumConfigurationError: naming the order of calls that works.
    """
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
    """Each parameter's local shard on this rank: ``p.to_local()`` of a ``DTensor`` (a view of the parameter's
    own storage, as FSDP2 keeps it), the tensor itself for a plain one.

    Raises:
        AdasumConfigurationError: with a shard group of more than one rank, a parameter that is not a
            ``DTensor`` with ``Shard`` placements on a 1-D mesh of that group's ranks
            (:func:`check_sharded_parameters`).
    """
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
    """The whole tensor of a ``DTensor`` sharded over ``shard_group`` (``Shard(d)`` placement: FSDP2's chunks
    of ``ceil(n / S)`` along dim ``d``, the last ones shorter or empty); a plain tensor as it is. A collective
    on ``shard_group``: every rank of it calls this for the same tensors.

    Gathered by ``all_gather`` of the padded local shards on ``shard_group`` itself, not by
    ``DTensor.full_tensor()``: DTensor caches its redistribution plans by mesh, and meshes compare equal by
    layout, so in a process that destroyed an earlier mesh's groups and built an equal mesh the cached plan
    would name the destroyed groups.

    Returns:
        A new tensor of ``t``'s global shape, dtype and device.
    """
    if not isinstance(t, DTensor):
        return t.detach().clone()
    local = t.to_local().detach()
    size = world_size(shard_group)
    if size == 1:
        return local.clone()
    placement = t.placements[0]
    assert isinstance(placement, Shard), placement
    dim, n = placement.dim, t.shape[placement.dim]
    chunk = -(-n // size)
    padded = local.new_zeros((*local.shape[:dim], chunk, *local.shape[dim + 1 :]))
    padded.narrow(dim, 0, local.shape[dim]).copy_(local)
    parts = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(parts, padded.contiguous(), group=shard_group)
    return torch.cat(parts, dim=dim).narrow(dim, 0, n).clone()


def local_chunk(whole: torch.Tensor, param: torch.Tensor, shard_group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's chunk of ``whole`` (a tensor of ``param``'s global shape) as FSDP2 cuts ``param``: its
    ``Shard(d)`` chunk of ``ceil(n / S)`` along dim ``d`` (the last ones shorter or empty), a view; ``whole``
    itself when ``param`` is not a ``DTensor``.

    Raises:
        ValueError: ``whole`` does not have ``param``'s global shape (a checkpoint of another model).
    """
    if tuple(whole.shape) != tuple(param.shape):
        raise ValueError(
            f"a saved tensor of shape {tuple(whole.shape)} cannot fill a parameter of shape "
            f"{tuple(param.shape)}: load a checkpoint of this model"
        )
    if not isinstance(param, DTensor):
        return whole
    placement = param.placements[0]
    assert isinstance(placement, Shard), placement
    dim, n = placement.dim, param.shape[placement.dim]
    size = world_size(shard_group)
    chunk = -(-n // size)
    start = min(chunk * (dist.get_rank(shard_group) if size > 1 else 0), n)
    return whole.narrow(dim, start, param.to_local().shape[dim])


def shard_module(
    module: Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None = None
) -> list[str]:
    """``fully_shard(child, mesh=mesh)`` on each top-level child of ``module`` that has parameters, then on
    ``module`` itself: one all-gather per child in forward (FSDP2's usual unit), the root's hooks around the
    whole step. A module that already holds FSDP2 modules (sharded by the user) is sharded at the root only;
    one that is itself an FSDP2 module is left alone.

    Args:
        module: the whole module, the same values on every rank of ``mesh`` (each keeps its own chunk).
        mesh: the 1-D mesh to shard over (``mesh_2d["shard"]``).
        mp_policy: FSDP2's mixed precision (e.g. ``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32)``: the sharded parameters, their steps and the Adasum stay float32).

    Returns:
        The names of the modules sharded here, in order (``""`` is ``module``).
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
    """``module.state_dict()`` with each sharded tensor gathered whole over ``shard_group``
    (:func:`full_tensor`): the layout of the unsharded module. A collective on ``shard_group``."""
    state = module.state_dict()
    if shard_group is None:
        return state
    return {k: full_tensor(v, shard_group) if isinstance(v, DTensor) else v for k, v in state.items()}


def load_full_state_dict(
    module: Module, state_dict: Mapping[str, Any], shard_group: dist.ProcessGroup, strict: bool = True
) -> tuple[list[str], list[str]]:
    """Fill a sharded module from a state dict of whole tensors (:func:`full_state_dict`'s, or an unsharded
    module's): each rank copies its own chunk of every sharded tensor (:func:`local_chunk`) into its local
    shard, and the other tensors (buffers) whole. No communication.

    Returns:
        ``(missing_keys, unexpected_keys)``.

    Raises:
        RuntimeError: with ``strict``, keys missing or unexpected (as ``Module.load_state_dict``).
        ValueError: a saved tensor of another shape.
    """
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
    """An optimizer's ``state_dict()`` with its ``DTensor`` values as plain local shards (copies): what this
    rank saves of its group's optimizer state."""
    return {
        **state_dict,
        "state": {
            key: {k: v.to_local().clone() if isinstance(v, DTensor) else v for k, v in values.items()}
            for key, values in state_dict.get("state", {}).items()
        },
    }


def optimizer_state_to_shards(optimizer: Optimizer, shard_group: dist.ProcessGroup, whole: bool) -> None:
    """After ``optimizer.load_state_dict`` of plain tensors: each per-parameter state tensor (of dim ≥ 1) of a
    ``DTensor`` parameter becomes a ``DTensor`` shard like its parameter, in place — this rank's chunk of it
    with ``whole`` (a state saved unsharded), else the tensor itself (this rank's saved shard). Scalars
    (``step``) stay as they are."""
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
    """Run ``local_step`` (this replica group's sharded optimizer step), then replace its update of ``params``
    by the Adasum of every replica group's update: ``θ := θ_before + Adasum(θ_after − θ_before)`` per whole
    parameter: the statistics ``[a·b, ‖a‖², ‖b‖²]`` of the local shards in float64 summed over
    ``shard_group``, Horovod's coefficients (``adasum.h``), the combination in float64 rounded once.

    ``params`` are FSDP2's sharded parameters (``DTensor`` with ``Shard`` placements on ``mesh["shard"]``).
    Each rank copies its local shards (``to_local()``, a view of the parameter's storage) into one flat buffer
    per dtype and device (θ_before, kept between steps: **one shard of the parameters**, the only buffer of
    their size that the step keeps), runs ``local_step``, turns each local shard into its own delta in place
    (``θ_after − θ_before``), combines the deltas across the replica groups and adds θ_before back. The
    partner group's deltas are received into the parameters' sharded gradients (``p.grad.to_local()``:
    FSDP2's own shard-sized memory, consumed by the step); a parameter without a gradient of its local shard's
    shape, dtype and device (``None``, frozen; another dtype; not contiguous) receives into a scratch buffer
    sized for those parameters alone (kept too; none in the usual case). Besides, the float64 statistics and
    combination work in chunks (:data:`~adasum_lightning.allreduce.CPU_CHUNK` /
    :data:`~adasum_lightning.allreduce.DEVICE_CHUNK` elements at most, independent of the model's size).

    **After the step the gradients of ``params`` are ``None``** (as after ``optimizer.zero_grad(
    set_to_none=True)``): they served as the receive buffer, so their values are gone; an optimizer must not
    keep the gradient tensors themselves in its state. With one replica group: ``local_step()`` alone, the
    gradients untouched. Every rank must call this for the same parameters at the same step. ``wire_dtype``
    (None, ``torch.bfloat16``, ``torch.float16``): every sent piece rounded to it (the deltas combined in a
    copy of that dtype, the statistics and the combination in float64 as without it).

    Raises:
        AdasumConfigurationError: a parameter is not sharded over ``shard_group`` (see :func:`local_shards`).
        TypeError: a parameter's dtype is not one the reduction supports.
        RuntimeError: from ``torch.distributed`` when a peer is lost or does not answer within ``timeout``.
    """
    if world_size(replicate_group) == 1:
        return local_step()
    params = [p for p in params if p.numel()]  # the whole tensor's size: the same on every rank
    shards = local_shards(params, shard_group)
    for i, t in enumerate(shards):
        _check_tensor(t, i)
    befores = {}
    with torch.no_grad():
        for key, bucket in _buckets(shards).items():
            before = workspace(sum(t.numel() for t in bucket), *key, slot=_STEP_SLOTS[0])
            torch.cat([t.reshape(-1) for t in bucket], out=before)
            befores[key] = before
    output = local_step()
    with torch.no_grad():
        shards = local_shards(params, shard_group)  # the same views, looked up again after the step
        receive = _gradient_buffers(params, shards)
        by_key: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i, t in enumerate(shards):
            by_key.setdefault((t.dtype, t.device), []).append(i)
        for key, ids in by_key.items():
            bucket, grads = [shards[i] for i in ids], [receive[i] for i in ids]
            _step_bucket(bucket, grads, befores[key], replicate_group, shard_group, timeout, wire_dtype)
        for p in params:
            p.grad = None  # the partner's deltas are in them now: released, as zero_grad(set_to_none=True)
    return output


#: The workspace slots (:func:`adasum_lightning.allreduce.workspace`) that :func:`sharded_adasum_step` keeps
#: between steps: θ_before (one shard of the parameters), and the scratch for the parameters whose gradients
#: cannot receive the partner's deltas (empty when every parameter has one).
_STEP_SLOTS: tuple[str, ...] = ("sharded-before", "sharded-scratch")


def _step_buffer_bytes() -> int:
    """The bytes of the buffers :func:`sharded_adasum_step` keeps for this thread between steps (the
    workspace slots :data:`_STEP_SLOTS`, every dtype and device): one shard of the stepped parameters when
    every parameter has a gradient at the step, more for those without. The float64 chunk scratch of the
    statistics (slots ``work64``, ``out64``, shared with the other reductions) is not counted."""
    kept = allreduce._workspace.__dict__
    return sum(
        buf.numel() * buf.element_size() for key, buf in kept.items() if key.split("|")[0] in _STEP_SLOTS
    )


# ---------------------------------------------------------------------------------------------------------
# Internals


def _buckets(tensors: Sequence[torch.Tensor]) -> dict[tuple[torch.dtype, torch.device], list[torch.Tensor]]:
    """Tensors by dtype and device, in order; empty local shards kept (the shard group's statistics align)."""
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        buckets.setdefault((t.dtype, t.device), []).append(t)
    return buckets


def _gradient_buffers(
    params: Sequence[torch.Tensor], shards: Sequence[torch.Tensor]
) -> list[torch.Tensor | None]:
    """Per parameter, its sharded gradient's local tensor where it can receive the partner's deltas in place
    of the local shard: contiguous, of the shard's shape, dtype and device, and not aliasing another one
    (tied parameters listed twice); else None (the scratch buffer receives them)."""
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
    replicate_group: dist.ProcessGroup,
    shard_group: dist.ProcessGroup,
    timeout: timedelta | None,
    wire_dtype: torch.dtype | None = None,
) -> None:
    """One dtype and device of :func:`sharded_adasum_step` after the local step: each local shard becomes
    its delta ``θ_after − θ_before`` in place (``before``: the flat θ_before), the deltas are combined across
    the replica groups (the partner's received into ``grads``, or the scratch slot where None; a shard that
    is not contiguous works in the scratch slot too; with ``wire_dtype``, in a flat copy of that dtype), and
    θ_before is added back."""
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
        _reduce_lists(own, recv, counts, before.device, replicate_group, shard_group, timeout)
    else:
        wire = workspace(sum(counts), wire_dtype, before.device, slot="wire")
        wire_recv = workspace(sum(counts), wire_dtype, before.device, slot="wire-recv")
        torch.cat(own, out=wire)
        wired = list(wire.split(counts))
        _reduce_lists(
            wired, list(wire_recv.split(counts)), counts, before.device, replicate_group, shard_group, timeout
        )
        for o, w in zip(own, wired, strict=True):
            o.copy_(w)
    offset = 0
    for t, o, n in zip(shards, own, counts, strict=True):
        if not t.is_contiguous():  # its delta was combined in the scratch slot
            t.copy_(o.view(t.shape))
        t.add_(before[offset : offset + n].view(t.shape))  # θ_before + combined, as adasum_step
        offset += n


def _exchange_lists(
    comm: _Comm, peer: int, send: Sequence[torch.Tensor] | None, recv: Sequence[torch.Tensor] | None
) -> None:
    """:meth:`_Comm.exchange` of lists: every non-empty tensor of ``send`` to group rank ``peer`` and of
    ``recv`` from it, in one ``batch_isend_irecv`` (one ``P2POp`` per tensor; the peer lists tensors of the
    same sizes in the same order, which is how ``torch.distributed`` matches the messages of one pair)."""
    ops = [
        dist.P2POp(op, t, comm.global_ranks[peer], comm.group)
        for op, tensors in ((dist.isend, send), (dist.irecv, recv))
        for t in tensors or ()
        if t.numel() > 0
    ]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            if comm.timeout is None:
                work.wait()
            else:
                work.wait(comm.timeout)


def _reduce_lists(
    own: list[torch.Tensor],
    recv: list[torch.Tensor],
    counts: list[int],
    device: torch.device,
    replicate_group: dist.ProcessGroup,
    shard_group: dist.ProcessGroup,
    timeout: timedelta | None,
) -> None:
    """Adasum over the replica groups of per-tensor 1-D buffers (module docstring's pairing): ``own`` (the
    local shards' deltas, reduced in place) and ``recv`` (of the same sizes, for the partner's)."""
    size = dist.get_world_size(replicate_group)
    comm = _Comm(replicate_group, dist.get_rank(replicate_group), size, timeout)
    q, size = comm.rank, comm.size
    p = 1 << (size.bit_length() - 1)  # largest power of 2 <= size
    if q >= p:  # folded into q - p; the result comes back at the end
        _exchange_lists(comm, q - p, own, None)
        _exchange_lists(comm, q - p, None, own)
        return
    plan = _plan(counts, CPU_CHUNK if device.type == "cpu" else DEVICE_CHUNK)
    pieces = _plan_pieces(plan, counts)
    if q + p < size:
        _exchange_lists(comm, q + p, None, recv)
        _combine_lists(own, recv, True, plan, pieces, shard_group)
    d = 1
    while d < p:
        _exchange_lists(comm, q ^ d, own, recv)
        _combine_lists(own, recv, q < q ^ d, plan, pieces, shard_group)
        d <<= 1
    if q + p < size:
        _exchange_lists(comm, q + p, own, None)


def _plan_pieces(plan: list, counts: list[int]) -> Pieces:
    """Per chunk of ``plan`` (:func:`~adasum_lightning.allreduce._plan` over the tensors laid back to back),
    its parts as ``(tensor index, start in the tensor, start in the chunk, length)``."""
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
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
    """``own := adasum(low, up)`` per whole tensor, ``low`` the lower replica index's shards: the statistics
    ``[low·up, ‖low‖², ‖up‖²]`` of the local shards summed over ``shard_group``, Horovod's coefficients
    (``adasum.h``), the combination in float64: the same operations in the same order on both partners."""
    low, up = (own, theirs) if own_is_low else (theirs, own)
    grams = _local_grams(low, up, plan, pieces, len(own))
    stats = grams[:, [1, 0, 3]].contiguous()
    if world_size(shard_group) > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=shard_group)
    _scaled_add(low, up, own, plan, pieces, _coefficients(stats, left=True))
