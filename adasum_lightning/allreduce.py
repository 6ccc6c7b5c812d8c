"""Adasum allreduce on ``torch.distributed`` point-to-point operations (no Horovod, no Lightning).

Horovod 0.28.1's MPI Adasum (``horovod/common/ops/adasum/adasum.h``) per flat bucket of one dtype and device:
the ranks above the largest power of 2 fold in, then vector halving / distance doubling (a binomial tree up to
:data:`TREE_MAX_BYTES`), coefficients ``1 - (L·R) / ‖L‖² · 0.5`` in float64, the combination rounded once.
Algorithm and tuning: docs/adasum_allreduce.md.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from itertools import accumulate

import torch
import torch.distributed as dist

from adasum_lightning.reference import ADASUM_NORM_EPS, is_power_of_two

__all__ = [
    "adasum_allreduce",
    "adasum_allreduce_flat",
    "mean_allreduce_flat",
    "release_workspace",
    "workspace",
]

#: Dtypes :func:`adasum_allreduce` reduces (Horovod's CPU Adasum has no bfloat16; this module does).
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: Elements per float64 work chunk on CPU (docs/adasum_allreduce.md, "Tuning").
CPU_CHUNK: int = 1 << 18
#: Elements per chunk on other devices: at most 256 MiB of float64 scratch.
DEVICE_CHUNK: int = 1 << 24
#: Buckets with ``bytes × log2(P)`` up to this take the binomial tree (fewer round trips).
TREE_MAX_BYTES: int = 8 << 20
#: Bytes per message of a large point-to-point exchange on Gloo.
GLOO_PIECE_BYTES: int = 4 << 20
#: Tensor parts of fewer elements are batched with their neighbours into one chunk (``segment_reduce``).
SMALL_TENSOR: int = 1 << 12


def adasum_allreduce(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    timeout: timedelta | None = None,
    wire_dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """Adasum allreduce of ``tensors`` across the ranks of ``group``, in place; the same bits on every rank.

    The order is :func:`adasum_lightning.reference.adasum_reduce`'s, one coefficient pair per tensor; returns
    ``tensors`` as a list. Buffers are kept per thread (:func:`release_workspace` frees them).

    Args:
        tensors: float16, bfloat16, float32 or float64 tensors, the same shapes and order on every rank.
        group: the process group (default: the default group); a non-member does nothing.
        timeout: how long one Gloo exchange waits for its peer (default: torch's 30 minutes).
        wire_dtype: None, or the dtype every sent piece is rounded to.

    Raises:
        TypeError: an element is not a tensor of a supported dtype.
        RuntimeError: from ``torch.distributed`` when a peer is lost or does not answer within ``timeout``.
    """
    out = tensors if isinstance(tensors, list) else list(tensors)
    for i, t in enumerate(out):
        check_tensor(t, i)
    comm = communicator(group, timeout) if out else None
    if comm is None:
        return out
    with torch.no_grad():
        for bucket in buckets(out).values():
            _reduce_bucket(bucket, comm, wire_dtype)
    return out


def adasum_allreduce_flat(
    flat: torch.Tensor,
    counts: Sequence[int],
    group: dist.ProcessGroup | None = None,
    timeout: timedelta | None = None,
    on_final: Callable[[int, int], None] | None = None,
    wire_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """:func:`adasum_allreduce` of tensors packed back to back into one flat buffer, in place.

    Args:
        flat: a contiguous 1-D tensor of a supported dtype, the same length on every rank.
        counts: the element counts of the tensors in it, in order.
        group, timeout: as for :func:`adasum_allreduce`.
        on_final: called as ``on_final(start, length)`` for disjoint ranges covering ``flat``, each once it
            holds the result (others may still be in flight); it must not write ``flat``.
        wire_dtype: None, or ``torch.bfloat16``/``torch.float16``: the allreduce runs on a copy in that dtype.

    Raises:
        TypeError: ``flat`` is not a tensor of a supported dtype.
        ValueError: ``flat`` is not contiguous and 1-D, or ``counts`` does not add up to its length.
    """
    check_tensor(flat, 0)
    if flat.dim() != 1 or not flat.is_contiguous():
        shape = tuple(flat.shape)
        raise ValueError(f"adasum_allreduce_flat needs a contiguous 1-D tensor, got shape {shape}")
    if sum(counts) != flat.numel():
        raise ValueError(f"counts add up to {sum(counts)}, but the buffer holds {flat.numel()} elements")
    comm = communicator(group, timeout) if flat.numel() else None
    if comm is not None and wire_dtype not in (None, flat.dtype):
        wire = workspace(flat.numel(), wire_dtype, flat.device, "wire").copy_(flat)

        def copy_back(start: int, length: int) -> None:  # each final range into ``flat``, then reported
            flat[start : start + length].copy_(wire[start : start + length])
            if on_final is not None:
                on_final(start, length)

        adasum_allreduce_flat(wire, counts, group, timeout, copy_back)
    elif comm is not None:
        with torch.no_grad():
            _reduce_flat(flat, list(counts), comm, on_final)
    elif on_final is not None and flat.numel():
        on_final(0, flat.numel())
    return flat


def mean_allreduce_flat(
    flat: torch.Tensor, group: dist.ProcessGroup | None = None, wire_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The mean of ``flat`` over the ranks of ``group``, in place.

    With ``wire_dtype``, the same bits on every rank: ``all_to_all_single`` of the rounded buffers, each part
    summed in rank order in float32 (float64) and rounded once, then ``all_gather``.
    """
    size, n = dist.get_world_size(group), flat.numel()
    if wire_dtype in (None, flat.dtype):
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        return flat.div_(size)
    part = -(-n // size)
    wire = workspace(part * size, wire_dtype, flat.device, "wire")
    wire[:n].copy_(flat)
    wire[n:].zero_()
    parts = workspace(part * size, wire_dtype, flat.device, "wire-parts")
    dist.all_to_all_single(parts, wire, group=group)
    rows = parts.view(size, part)
    mean = workspace(part, torch.promote_types(flat.dtype, torch.float32), flat.device, "wire-mean")
    mean.copy_(rows[0])
    for row in rows[1:]:
        mean.add_(row)
    rows[0].copy_(mean.div_(size))
    dist.all_gather(list(wire.view(size, part)), rows[0], group=group)
    return flat.copy_(wire[:n])


def release_workspace() -> None:
    """Free the buffers :func:`adasum_allreduce` keeps for this thread (they are re-created when needed)."""
    _workspace.__dict__.clear()


_workspace = threading.local()


def check_tensor(t: object, i: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"adasum_allreduce needs tensors, element {i} is a {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            "adasum_allreduce supports float16, bfloat16, float32 and float64 tensors; "
            f"element {i} is {t.dtype}"
        )


def buckets(tensors: Sequence[torch.Tensor]) -> dict[tuple[torch.dtype, torch.device], list[torch.Tensor]]:
    """``tensors`` by dtype and device, in order."""
    out: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault((t.dtype, t.device), []).append(t)
    return out


def communicator(group: dist.ProcessGroup | None, timeout: timedelta | None) -> Communicator | None:
    """The exchanges' context for this rank of ``group``; None for a non-member or a group of one."""
    rank = dist.get_rank(group)
    if rank < 0 or dist.get_world_size(group) == 1:
        return None
    return Communicator(
        group if group is not None else dist.group.WORLD, rank, dist.get_world_size(group), timeout
    )


def workspace(numel: int, dtype: torch.dtype, device: torch.device, slot: str = "recv") -> torch.Tensor:
    """An uninitialised 1-D buffer of ``numel`` elements for ``slot``, kept per thread, dtype and device."""
    key = f"{slot}|{dtype}|{device}"
    buf = getattr(_workspace, key, None)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        setattr(_workspace, key, buf)
    return buf[:numel]


def workspace_bytes(slots: Sequence[str]) -> int:
    """The bytes of this thread's kept buffers of ``slots`` (:func:`workspace`), every dtype and device."""
    kept = _workspace.__dict__.items()
    return sum(buf.numel() * buf.element_size() for key, buf in kept if key.split("|")[0] in slots)


def _gloo_wait_timeout(group: dist.ProcessGroup, timeout: timedelta | None) -> timedelta | None:
    """The limit of Gloo's point-to-point waits: ``timeout``, else torch's default; None off Gloo."""
    if dist.get_backend(group) != "gloo":
        return None
    return timeout if timeout is not None else dist.constants.default_pg_timeout


#: One tensor, a list of them, or None (nothing).
Tensors = torch.Tensor | Sequence[torch.Tensor] | None


def _listed(tensors: Tensors) -> Sequence[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else tensors or ()


class Communicator:
    """Point-to-point exchanges inside one process group, by group rank."""

    def __init__(
        self, group: dist.ProcessGroup, rank: int, size: int, timeout: timedelta | None = None
    ) -> None:
        self.group, self.rank, self.size = group, rank, size
        self.timeout = _gloo_wait_timeout(group, timeout)
        # P2POp takes a global ``peer`` in every torch ≥ 2.1 (``group_peer`` exists only from 2.6 on).
        self.global_ranks = [dist.get_global_rank(group, r) for r in range(size)]

    def wait(self, work: dist.Work) -> None:
        """Wait for ``work`` once (a second ``wait()`` on a completed Gloo receive blocks for ever)."""
        work.wait() if self.timeout is None else work.wait(self.timeout)

    def exchange(self, peer: int, send: Tensors = None, recv: Tensors = None) -> None:
        """Send ``send`` to and receive ``recv`` from group rank ``peer`` concurrently; empty ones skipped."""
        self.start(peer, send, recv).wait()

    def start(self, peer: int, send: Tensors = None, recv: Tensors = None) -> _Exchange:
        """Post :meth:`exchange`'s messages without waiting (``recv`` arrives piece by piece).

        A tensor or a list of tensors each way; on Gloo a large 1-D tensor goes as pieces of
        :data:`GLOO_PIECE_BYTES` (several in flight keep the connection busy), tagged by their index.
        """
        sends = [p for t in _listed(send) if t.numel() for p in self._pieces(t)]
        recvs = [p for t in _listed(recv) if t.numel() for p in self._pieces(t)]
        to = self.global_ranks[peer]
        ops = [dist.P2POp(dist.isend, t, to, self.group, tag) for tag, t in enumerate(sends)]
        ops += [dist.P2POp(dist.irecv, t, to, self.group, tag) for tag, t in enumerate(recvs)]
        works = dist.batch_isend_irecv(ops) if ops else []
        ends = list(accumulate(t.numel() for t in recvs))
        return _Exchange(self, works[: len(sends)], works[len(sends) :], ends)

    def _pieces(self, t: torch.Tensor) -> list[torch.Tensor]:
        if self.timeout is None or t.dim() != 1 or t.numel() * t.element_size() <= GLOO_PIECE_BYTES:
            return [t]
        return list(t.split(max(1, GLOO_PIECE_BYTES // t.element_size())))

    def group_sum(self, values: torch.Tensor, width: int) -> torch.Tensor:
        """Sum of ``values`` over the block of ``width`` (a power of 2) ranks holding ours, the same bits on
        each: pairwise swaps (``all_reduce`` on sub-groups would need a world-wide ``new_group``)."""
        step = 1
        while step < width:
            theirs = torch.empty_like(values)
            self.exchange(self.rank ^ step, values, theirs)
            values = values + theirs
            step <<= 1
        return values


class _Exchange:
    """The messages of one :meth:`Communicator.start`, waited for once each."""

    def __init__(self, comm: Communicator, sends: list, recvs: list, ends: list[int]) -> None:
        self.comm, self.sends, self.recvs = comm, sends, recvs
        self.ends = ends  # elements of the receive buffer complete once recvs[i] is done
        self.received = 0  # recvs waited for

    def wait_received(self, upto: int) -> None:
        """Wait until the receive buffer holds its first ``upto`` elements."""
        while self.received < len(self.recvs) and (self.received == 0 or self.ends[self.received - 1] < upto):
            self.comm.wait(self.recvs[self.received])
            self.received += 1

    def wait(self) -> None:
        """Wait for every message."""
        self.wait_received(self.ends[-1] if self.ends else 0)
        for work in self.sends:
            self.comm.wait(work)
        self.sends = []


def _reduce_bucket(
    bucket: list[torch.Tensor], comm: Communicator, wire_dtype: torch.dtype | None = None
) -> None:
    counts = [t.numel() for t in bucket]
    first, dtype = bucket[0], wire_dtype or bucket[0].dtype
    if sum(counts) == 0:
        return
    if len(bucket) == 1 and first.is_contiguous() and dtype == first.dtype:
        _reduce_flat(first.view(-1), counts, comm)
        return
    flat = workspace(sum(counts), dtype, first.device, slot="flat")
    torch.cat([t.reshape(-1) for t in bucket], out=flat)
    _reduce_flat(flat, counts, comm)
    for t, piece in zip(bucket, flat.split(counts), strict=True):
        t.copy_(piece.view(t.shape))


def _reduce_flat(
    flat: torch.Tensor,
    counts: list[int],
    comm: Communicator,
    on_final: Callable[[int, int], None] | None = None,
) -> None:
    """Adasum allreduce of ``flat`` (tensors of ``counts`` elements), in place; ``on_final`` as for
    :func:`adasum_allreduce_flat`."""
    rank, size = comm.rank, comm.size
    p = 1 << (size.bit_length() - 1)  # largest power of 2 <= size
    total = flat.numel()
    if not is_power_of_two(size) and flat.device.type != "cpu":
        # NCCL: a group's first collective, if a batch_isend_irecv, needs every rank (torch docs)
        dist.all_reduce(torch.zeros(1, device=flat.device), group=comm.group)
    if rank >= p:  # extra rank: hand the data to rank - p, get the result back
        comm.exchange(rank - p, flat, None)
        comm.exchange(rank - p, None, flat)
        if on_final is not None:
            on_final(0, total)
        return
    offsets = list(accumulate(counts, initial=0))
    has_extra = rank + p < size
    halving = total * flat.element_size() * (p.bit_length() - 1) > TREE_MAX_BYTES
    recv = workspace(total if has_extra or not halving else (total + 1) // 2, flat.dtype, flat.device)
    if has_extra:  # fold x[rank + p] in: adasum(x[rank], x[rank + p]) on whole tensors, computed here
        comm.exchange(rank + p, None, recv)
        _local_pair(flat, recv, offsets)
    if halving:
        _halving_doubling(flat, recv, offsets, comm, p, on_final)
    else:
        _binomial_tree(flat, recv[:total], offsets, comm, p)
        if on_final is not None:
            on_final(0, total)
    if has_extra:
        comm.exchange(rank + p, flat, None)


def _binomial_tree(
    flat: torch.Tensor, recv: torch.Tensor, offsets: list[int], comm: Communicator, p: int
) -> None:
    """Reduce whole buckets up a binomial tree to rank 0 (pairs as in Horovod's order), broadcast back."""
    rank = comm.rank
    d = 1
    while d < p:
        if rank & d:  # the upper block's holder: hand it to the lower one, wait for the result below
            comm.exchange(rank - d, flat, None)
            break
        comm.exchange(rank + d, None, recv)
        _local_pair(flat, recv, offsets)
        d <<= 1
    d = p >> 1
    while d >= 1:
        if rank % (2 * d) == 0:
            comm.exchange(rank + d, flat, None)
        elif rank % (2 * d) == d:
            comm.exchange(rank - d, None, flat)
        d >>= 1


def _local_pair(low: torch.Tensor, high: torch.Tensor, offsets: list[int]) -> None:
    """``low := adasum(low, high)`` per tensor (boundaries ``offsets``), on whole tensors, in this rank."""
    counts = [offsets[i + 1] - offsets[i] for i in range(len(offsets) - 1)]
    plan = plan_chunks(counts, CPU_CHUNK if low.device.type == "cpu" else DEVICE_CHUNK)
    pieces = _flat_pieces(plan)
    grams = local_grams([low], [high], plan, pieces, len(counts))
    scaled_add([low], [high], [low], plan, pieces, coefficients(grams[:, [1, 0, 3]], left=True))


def _halving_doubling(
    flat: torch.Tensor,
    recv: torch.Tensor,
    offsets: list[int],
    comm: Communicator,
    p: int,
    on_final: Callable[[int, int], None] | None = None,
) -> None:
    """Horovod's vector halving / distance doubling over group ranks ``0 … p-1``, then distance halving;
    ``on_final`` sees the last level's segment chunk by chunk, then each segment received back."""
    rank = comm.rank
    num = len(offsets) - 1
    chunk = CPU_CHUNK if flat.device.type == "cpu" else DEVICE_CHUNK
    lo, n = 0, flat.numel()  # [lo, lo + n): the segment this rank holds
    history: list[tuple[int, int, int, int]] = []  # per level: this rank's part and the neighbour's
    d = 1
    while d < p:
        peer = rank ^ d
        half = n >> 1
        left = (rank & d) == 0
        if left:  # keep [lo, lo + half), give [lo + half, lo + n)
            keep_lo, keep_n, give_lo, give_n = lo, half, lo + half, n - half
        else:  # keep [lo + half, lo + n), give [lo, lo + half)
            keep_lo, keep_n, give_lo, give_n = lo + half, n - half, lo, half
        history.append((keep_lo, keep_n, give_lo, give_n))
        a = flat[keep_lo : keep_lo + keep_n]  # own data
        b = recv[:keep_n]  # the neighbour's data for the same elements
        # The products of each chunk are taken as soon as its part of ``b`` has arrived.
        incoming = comm.start(peer, flat[give_lo : give_lo + give_n], b)
        plan = plan_chunks(_segment_counts(offsets, keep_lo, keep_n), chunk)
        pieces = _flat_pieces(plan)
        grams = local_grams([a], [b], plan, pieces, num, ready=incoming.wait_received)
        incoming.wait()
        # Horovod's layout: [dot, ‖lower half's data‖², ‖upper half's data‖²], summed over the 2·d ranks.
        stats = comm.group_sum(grams[:, [1, 0, 3] if left else [1, 3, 0]].contiguous(), 2 * d)
        d <<= 1
        if d < p:
            scaled_add([a], [b], [a], plan, pieces, coefficients(stats, left))
        else:  # the last level: each combined piece of ``a`` leaves for the first swap back at once
            back = _Outgoing(comm, rank ^ (d >> 1), flat, (keep_lo, keep_n), (give_lo, give_n), on_final)
            scaled_add([a], [b], [a], plan, pieces, coefficients(stats, left), done=back.written)
            back.wait()
        lo, n = keep_lo, keep_n
    # Distance halving: swap the reduced segments back (the last level's swap is done above).
    for i in reversed(range(len(history) - 1)):
        keep_lo, keep_n, give_lo, give_n = history[i]
        comm.exchange(rank ^ (1 << i), flat[keep_lo : keep_lo + keep_n], flat[give_lo : give_lo + give_n])
        if on_final is not None and give_n:
            on_final(give_lo, give_n)


class _Outgoing:
    """The swap back of the last halving level: the ``send`` range of ``flat`` sent piece by piece as it is
    written, the peer's received into the ``recv`` range; ``on_final`` sees both."""

    def __init__(
        self,
        comm: Communicator,
        peer: int,
        flat: torch.Tensor,
        send: tuple[int, int],
        recv: tuple[int, int],
        on_final: Callable[[int, int], None] | None = None,
    ) -> None:
        self.comm = comm
        self.peer = comm.global_ranks[peer]
        (self.send_lo, send_n), (self.recv_lo, recv_n) = send, recv
        self.on_final = on_final
        self.pieces = comm._pieces(flat[self.send_lo : self.send_lo + send_n]) if send_n else []
        self.sent = 0  # pieces posted
        self.end = 0  # elements of the sent segment they cover
        self.reported = 0  # elements of the sent segment passed to ``on_final``
        self.recvs = comm._pieces(flat[self.recv_lo : self.recv_lo + recv_n]) if recv_n else []
        self.works = [dist.irecv(t, self.peer, comm.group, tag) for tag, t in enumerate(self.recvs)]

    def written(self, upto: int) -> None:
        """The sent segment's first ``upto`` elements are final: post the pieces they complete."""
        while self.sent < len(self.pieces) and self.end + self.pieces[self.sent].numel() <= upto:
            piece = self.pieces[self.sent]
            self.works.append(dist.isend(piece, self.peer, self.comm.group, self.sent))
            self.end += piece.numel()
            self.sent += 1
        if self.on_final is not None and upto > self.reported:
            self.on_final(self.send_lo + self.reported, upto - self.reported)
            self.reported = upto

    def wait(self) -> None:
        """Post what is left and wait for every message."""
        self.written(self.end + sum(t.numel() for t in self.pieces[self.sent :]))
        at = self.recv_lo
        for i, work in enumerate(self.works):  # the receives come first, in the order of ``recvs``
            self.comm.wait(work)
            if self.on_final is not None and i < len(self.recvs):
                self.on_final(at, self.recvs[i].numel())
                at += self.recvs[i].numel()


def _segment_counts(offsets: list[int], lo: int, n: int) -> list[int]:
    """Elements of each tensor (boundaries ``offsets``) inside the flat range ``[lo, lo + n)``."""
    hi = lo + n
    return [max(0, min(hi, offsets[i + 1]) - max(lo, offsets[i])) for i in range(len(offsets) - 1)]


def plan_chunks(counts: list[int], chunk: int) -> list[tuple[int, int, list[int], list[int]]]:
    """Work chunks ``(start, stop, tensor_ids, lengths)`` over tensors of ``counts`` elements: a part of one
    large tensor, or a run of small ones of at most ``min(chunk, 2**18)`` elements."""
    chunks: list[tuple[int, int, list[int], list[int]]] = []
    run: list[tuple[int, int]] = []  # (tensor index, length) of the small tensors since the last chunk
    start = run_n = 0

    def flush() -> None:
        if run:
            chunks.append((start - run_n, start, [i for i, _ in run], [n for _, n in run]))
            run.clear()

    for i, c in enumerate(counts):
        if c >= SMALL_TENSOR:
            flush()
            run_n = 0
            chunks += [
                (s, min(s + chunk, start + c), [i], [min(chunk, start + c - s)])
                for s in range(start, start + c, chunk)
            ]
        elif c:
            run.append((i, c))
            run_n += c
        start += c
        if run_n >= min(chunk, 1 << 18):
            flush()
            run_n = 0
    flush()
    return chunks


#: Per chunk of a plan, its parts as ``(tensor index, start in the tensor, start in the chunk, length)``.
Pieces = list[list[tuple[int, int, int, int]]]


def _flat_pieces(plan: list) -> Pieces:
    """The pieces of ``plan`` over one flat buffer (tensor index 0): each chunk is one part."""
    return [[(0, s, 0, e - s)] for s, e, _, _ in plan]


def _fill_rows(
    m: torch.Tensor, a: list[torch.Tensor], b: list[torch.Tensor], parts: list[tuple[int, int, int, int]]
) -> None:
    """``m[0]``, ``m[1]`` := one chunk of ``a``, ``b`` (exact in float64)."""
    for i, at, o, n in parts:
        m[0, o : o + n].copy_(a[i][at : at + n])
        m[1, o : o + n].copy_(b[i][at : at + n])


def local_grams(
    a: list[torch.Tensor],
    b: list[torch.Tensor],
    plan: list,
    pieces: Pieces,
    num: int,
    ready: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """Per tensor, float64 ``[a·a, a·b, b·a, b·b]``: shape ``(num, 4)``; ``ready(e)`` is called before the
    chunk ending at plan offset ``e`` is read."""
    device = a[0].device
    cmax = max((e - s for s, e, _, _ in plan), default=0)
    work = workspace(2 * cmax, torch.float64, device, slot="work64").view(2, cmax)
    # One row per (chunk, tensor in it): the Gram matrix of (own, received), row-major.
    rows_per_tensor = [0] * num
    for _, _, ids, _ in plan:
        for i in ids:
            rows_per_tensor[i] += 1
    grams = torch.empty(sum(rows_per_tensor), 4, dtype=torch.float64, device=device)
    row = 0
    for (s, e, ids, lengths), parts in zip(plan, pieces, strict=True):
        m = work[:, : e - s]
        if ready is not None:
            ready(e)
        _fill_rows(m, a, b, parts)
        if len(ids) == 1:
            torch.mm(m, m.t(), out=grams[row].view(2, 2))
            row += 1
        else:
            mt = m.t()
            prods = (mt.unsqueeze(2) * mt.unsqueeze(1)).view(e - s, 4)
            lens = torch.tensor(lengths, device=device)
            grams[row : row + len(ids)] = torch.segment_reduce(prods, "sum", lengths=lens, axis=0)
            row += len(ids)
    return torch.segment_reduce(grams, "sum", lengths=torch.tensor(rows_per_tensor, device=device), axis=0)


def coefficients(stats: torch.Tensor, left: bool) -> torch.Tensor:
    """Horovod's coefficients from summed ``[dot, ‖low‖², ‖up‖²]`` rows: ``(num, 2)`` (own, received)."""
    dot, low_sq, up_sq = stats.unbind(1)
    one = torch.ones((), dtype=torch.float64, device=stats.device)
    # Same float64 operations in the same order as adasum.h: 1.0 - dot / normsq * 0.5
    c_low = torch.where(low_sq >= ADASUM_NORM_EPS, 1.0 - dot / low_sq * 0.5, one)
    c_up = torch.where(up_sq >= ADASUM_NORM_EPS, 1.0 - dot / up_sq * 0.5, one)
    return torch.stack([c_low, c_up] if left else [c_up, c_low], dim=1)


def scaled_add(
    a: list[torch.Tensor],
    b: list[torch.Tensor],
    out: list[torch.Tensor],
    plan: list,
    pieces: Pieces,
    coeffs: torch.Tensor,
    done: Callable[[int], None] | None = None,
) -> None:
    """``out := coeffs[i, 0]·a + coeffs[i, 1]·b`` per tensor ``i`` in float64, rounded once (``out`` may be
    ``a`` or ``b``); ``done(e)`` is called once the chunk ending at plan offset ``e`` is written."""
    device = a[0].device
    cmax = max((e - s for s, e, _, _ in plan), default=0)
    work = workspace(2 * cmax, torch.float64, device, slot="work64").view(2, cmax)
    y64 = workspace(cmax, torch.float64, device, slot="out64")
    for (s, e, ids, lengths), parts in zip(plan, pieces, strict=True):
        m = work[:, : e - s]
        _fill_rows(m, a, b, parts)
        y = y64[: e - s]
        if len(ids) == 1:
            torch.mv(m.t(), coeffs[ids[0]], out=y)
        else:
            ce = coeffs[ids].repeat_interleave(torch.tensor(lengths, device=device), dim=0, output_size=e - s)
            torch.sum(m.t() * ce, dim=1, out=y)
        for i, at, o, n in parts:
            out[i][at : at + n].copy_(y[o : o + n])
        if done is not None:
            done(e)
