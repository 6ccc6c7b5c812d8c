"""``adasum_allreduce`` (Adasum on torch.distributed): real Gloo processes, every rank's result checked
against the reference operator and against Horovod's own Adasum allreduce; plus in-process unit tests."""

from __future__ import annotations

import json
import random
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import adasum_lightning.allreduce as ar
from adasum_lightning.allreduce import adasum_allreduce
from adasum_lightning.reference import ADASUM_NORM_EPS, adasum, adasum_reduce, is_power_of_two
from tests.cases import Launch, case
from tests.helpers import run_torchrun

#: max |ours - expected| / max |expected| per dtype (the reference rounds each pairwise step to the dtype,
#: as the allreduce does; low-precision dtypes may still differ by an ulp where a coefficient's last bit
#: differs)
REL_TOL = {"torch.float64": 1e-12, "torch.float32": 1e-5, "torch.float16": 2e-3, "torch.bfloat16": 1e-2}


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    """max |out - expected| / max |expected| (the absolute difference where ``expected`` is all zeros)."""
    scale = expected.double().abs().max().item() if expected.numel() else 0.0
    diff = (out.double() - expected.double()).abs().max().item() if expected.numel() else 0.0
    return diff / scale if scale > 0 else diff


def float32_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element, how many float32 values lie between ``a`` and ``b`` (0: equal; +0 and -0 equal)."""

    def key(x: torch.Tensor) -> torch.Tensor:
        bits = x.contiguous().view(torch.int32).to(torch.int64)
        return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)

    return (key(a) - key(b)).abs()


# ---------------------------------------------------------------------------------------------------------
# Real processes (Gloo)


def check_all_cases(calls: list[dict]) -> None:
    """``calls``: each member's result of one all-cases call, in group-rank order."""
    n = len(calls)
    first = calls[0]
    for r, res in enumerate(calls):
        assert res["returned_same_list"] and res["strides_kept"]
        for dt, name in first["order"]:
            inputs = [calls[k]["inputs"][dt][name] for k in range(n)]
            out = res["outputs"][(dt, name)]
            assert out.shape == inputs[r].shape and str(out.dtype) == dt, (dt, name)
            assert torch.equal(out, first["outputs"][(dt, name)]), (r, dt, name)  # bitwise, every rank
            expected = adasum_reduce(inputs)
            assert not torch.isnan(out).any(), (dt, name)
            assert rel_err(out, expected) <= REL_TOL[dt], (n, r, dt, name, rel_err(out, expected))
            if name == "identical":  # adasum(x, x) = x exactly
                assert torch.equal(out, inputs[0])
            if name == "zero_everywhere":
                assert torch.equal(out, torch.zeros_like(out))
            if name == "zero_on_rank0" and n == 2:  # the other rank's update comes through unchanged
                assert torch.equal(out, inputs[1])
            if is_power_of_two(n) and name == "anti_parallel":  # x and -x cancel
                assert out.abs().max().item() <= 1e-6
            if is_power_of_two(n) and name == "parallel":  # parallel updates: their mean
                mean = torch.stack([x.double() for x in inputs]).mean(0)
                assert rel_err(out, mean) <= REL_TOL[dt], (dt, rel_err(out, mean))


GLOO = {
    (np, tuple(k)): case(
        Launch("torchrun", np), f"adasum_allreduce-gloo-{np}", "adasum_allreduce", "gloo", *map(str, k)
    )
    for np, k in [(2, []), (4, [3]), (8, [5, 6, 7])]
}


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("np", "prefix_groups"),
    [pytest.param(np, list(k), marks=pytest.mark.cases(c)) for (np, k), c in GLOO.items()],
)
def test_equals_the_reference_on_every_rank(np, prefix_groups, cases):
    """Default groups of 2, 4 and 8 ranks; groups of 3 (of 4) and of 5, 6, 7 (of 8) first ranks.

    Non-powers of 2 run as sub-groups in the launches of 4 and 8 processes: the same code as a default
    group of that size plus the group-to-global rank mapping.
    """
    ranks = cases[GLOO[np, tuple(prefix_groups)]].ranks
    assert [(res["rank"], res["size"]) for res in ranks] == [(r, np) for r in range(np)]
    for path in (0, 1):  # binomial tree, vector halving
        check_all_cases([res["world"][path] for res in ranks])
    for k in prefix_groups:
        for path in (0, 1):
            check_all_cases([res["prefix"][k][path] for res in ranks[:k]])
        assert all(res["prefix"][k] is None for res in ranks[k:])
    for r, res in enumerate(ranks):
        # the multi-chunk float32 tensor alone, reduced in its own memory (binomial tree, halving)
        expected = adasum_reduce([ranks[k]["single_input"] for k in range(np)])
        for path in (0, 1):
            assert res["single_same_memory"][path]
            assert rel_err(res["single"][path], expected) <= 1e-5
            assert torch.equal(res["single"][path], ranks[0]["single"][path])
        # adasum_allreduce_flat's on_final: disjoint ranges covering the buffer, each final when reported
        for path in (0, 1):
            assert_final_when_reported(res["final_ranges"][path], res["single"][path], (r, path))
        # sub-group of ranks 1 … np-1; rank 0 is not in it and keeps its tensors
        if r == 0:
            for before, after in zip(res["sub_inputs"], res["sub_outputs"], strict=True):
                assert torch.equal(before, after)
        else:
            for i, after in enumerate(res["sub_outputs"]):
                expected = adasum_reduce([ranks[k]["sub_inputs"][i] for k in range(1, np)])
                assert rel_err(after, expected) <= REL_TOL[str(after.dtype)], (r, i)
                assert torch.equal(after, ranks[1]["sub_outputs"][i])


def assert_final_when_reported(final: dict, expected: torch.Tensor, what: tuple) -> None:
    """``final_ranges``' buffer equals ``expected``, and ``on_final`` saw disjoint ranges covering it, each
    holding its final values when reported."""
    assert torch.equal(final["flat"], expected), what
    covered = torch.zeros(final["flat"].numel(), dtype=torch.int64)
    for start, length, values in final["seen"]:
        covered[start : start + length] += 1
        assert torch.equal(values, final["flat"][start : start + length]), (*what, start)
    assert torch.equal(covered, torch.ones_like(covered)), what


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("np", "prefix_groups"),
    [pytest.param(np, list(k), marks=pytest.mark.cases(c)) for (np, k), c in GLOO.items()],
)
def test_a_16_bit_wire_equals_the_reference_of_rounded_inputs_on_every_rank(np, prefix_groups, cases):
    """``wire_dtype`` (``compression``): the Adasum is ``reference.adasum_reduce`` of the inputs rounded to
    the wire dtype (each level rounded to it); the mean sums the rounded inputs in float32 in rank order,
    divides by N and rounds once. Both bitwise on every rank, and not what a float32 wire gives."""
    ranks = cases[GLOO[np, tuple(prefix_groups)]].ranks
    for wire in (torch.bfloat16, torch.float16):
        dt = str(wire)
        inputs = [res["wire"][dt]["inputs"] for res in ranks]
        adasum = [adasum_reduce([x[i].to(wire) for x in inputs]).float() for i in range(len(inputs[0]))]
        flat = [torch.cat([t.reshape(-1) for t in x]).to(wire) for x in inputs]
        total = flat[0].float()
        for x in flat[1:]:
            total = total + x.float()
        mean = (total / np).to(wire).float()
        large = adasum[-1]
        assert rel_err(large, adasum_reduce([x[-1] for x in inputs])) > REL_TOL["torch.float32"], dt
        for r, res in enumerate(ranks):
            got = res["wire"][dt]
            for path in ("tree", "halving"):
                assert torch.equal(got["flat"][path], torch.cat([a.reshape(-1) for a in adasum])), (dt, r)
            assert torch.equal(got["mean"], mean), (dt, r)
            for i, out in enumerate(got["list"]):
                assert torch.equal(out, adasum[i]), (dt, r, i)
            for path in (0, 1):
                assert_final_when_reported(got["final_ranges"][path], large, (dt, r, path))


HOROVOD = {np: case(Launch("horovodrun", np), f"adasum_allreduce-horovod-{np}", "adasum_allreduce", "horovod")
           for np in (2, 4)}  # fmt: skip


@pytest.mark.mpi
@pytest.mark.parametrize("np", [pytest.param(np, marks=pytest.mark.cases(c)) for np, c in HOROVOD.items()])
def test_equals_horovods_adasum(np, cases):
    ranks = cases[HOROVOD[np]].ranks
    worst = {"torch.float32": 0, "torch.float64": 0.0}
    differing = {"tree": 0, "halving": 0}  # float32 elements ≠ Horovod's (rank 0)
    for r, res in enumerate(ranks):
        for path, (dt, name) in ((p, key) for p in ("tree", "halving") for key in res["ours"][p]):
            ours = res["ours"][path][(dt, name)]
            theirs = res["horovod"][(dt, name)]
            assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
            assert torch.equal(ours, ranks[0]["ours"][path][(dt, name)]), (r, path, dt, name)
            if dt == "torch.float32":
                ulps = int(float32_ulps(ours, theirs).max())
                assert ulps <= 1, (r, path, name, ulps)
                differing[path] += int((ours != theirs).sum()) if r == 0 else 0
                worst[dt] = max(worst[dt], ulps)
            else:  # relative to the inputs' scale: where they cancel (x, -x) Horovod's fused
                # multiply-add leaves ~1e-17 residues and ours may give exact zeros
                scale = max(
                    [theirs.abs().max().item()] + [k["inputs"][dt][name].abs().max().item() for k in ranks]
                )
                err = (ours - theirs).abs().max().item() / max(scale, 1e-300)
                assert err <= 1e-14, (r, path, name, err)
                worst[dt] = max(worst[dt], err)
    print(
        f"N={np}: float32 max {worst['torch.float32']} ulp ({differing} elements differ), "
        f"float64 max {worst['torch.float64']:.2e} relative"
    )


# ---------------------------------------------------------------------------------------------------------
# In-process


@pytest.mark.mpi
@pytest.mark.walltime
def test_a_silent_peer_raises_within_the_timeout(tmp_path):
    # Gloo's point-to-point handles wait without limit unless given one: a rank behind a lost link would
    # block the others until the kernel gives up on the connection (tests/test_two_hosts.py).
    run_torchrun(2, "p2p_timeout", str(tmp_path), "2", check=False, timeout=120)
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert result["error"] is not None and result["error"]["type"] == "RuntimeError", result
    assert "Timed out" in result["error"]["message"], result
    assert 1.5 <= result["seconds"] < 4, result  # rank 1 stays silent for 7 s


def test_gloo_waits_default_to_torchs_process_group_timeout(single_process_group):
    group = dist.group.WORLD
    assert ar._gloo_wait_timeout(group, None) == dist.constants.default_pg_timeout == timedelta(minutes=30)
    assert ar._gloo_wait_timeout(group, timedelta(seconds=5)) == timedelta(seconds=5)


@pytest.mark.parametrize(
    "dtype", [torch.int64, torch.int32, torch.bool, torch.complex64, torch.float8_e4m3fn]
)
def test_unsupported_dtype_raises_type_error_naming_it(dtype):
    with pytest.raises(TypeError, match=str(dtype)):
        adasum_allreduce([torch.ones(3), torch.zeros(2, dtype=dtype)])


def test_non_tensor_raises_type_error():
    with pytest.raises(TypeError, match="element 1 is a list"):
        adasum_allreduce([torch.ones(3), [1.0, 2.0]])


def test_empty_list_is_a_no_op_without_a_process_group():
    tensors: list[torch.Tensor] = []
    assert adasum_allreduce(tensors) is tensors


@pytest.fixture
def single_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_world_size_one_is_a_no_op(single_process_group):
    x = torch.randn(4, 3)
    y = torch.randn(5, dtype=torch.float64)
    before = (x.clone(), y.clone())
    tensors = [x, y]
    assert adasum_allreduce(tensors) is tensors
    assert torch.equal(x, before[0]) and torch.equal(y, before[1])


def test_flat_buffer_of_one_rank_is_final_at_once(single_process_group):
    flat, seen = torch.arange(10.0), []
    ar.adasum_allreduce_flat(flat, [4, 6], on_final=lambda start, length: seen.append((start, length)))
    assert seen == [(0, 10)] and torch.equal(flat, torch.arange(10.0))


def test_gloo_sends_one_dimensional_buffers_in_pieces(single_process_group, monkeypatch):
    monkeypatch.setattr(ar, "GLOO_PIECE_BYTES", 1024)
    comm = ar.Communicator(dist.group.WORLD, 0, 1)
    flat = torch.arange(1000, dtype=torch.float32)  # 4000 bytes: 256-element pieces, in order
    pieces = comm._pieces(flat)
    assert [p.numel() for p in pieces] == [256, 256, 256, 232]
    assert torch.equal(torch.cat(pieces), flat) and pieces[1].data_ptr() == flat[256:].data_ptr()
    assert comm._pieces(torch.zeros(2, 500))[0].shape == (2, 500)  # not 1-D: one message
    assert len(comm._pieces(torch.zeros(256))) == 1


def test_workspace_is_reused_and_released():
    buf = ar.workspace(100, torch.float32, torch.device("cpu"))
    assert ar.workspace(50, torch.float32, torch.device("cpu")).data_ptr() == buf.data_ptr()
    assert ar.workspace(200, torch.float32, torch.device("cpu")).numel() == 200  # grows
    ar.release_workspace()
    assert not vars(ar._workspace)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_pairwise_step_equals_the_operator_per_tensor(dtype, monkeypatch):
    """One local pair step over a flat buffer of many tensors equals ``adasum`` per tensor."""
    # small chunks so that large tensors span several chunks and small ones share one
    monkeypatch.setattr(ar, "CPU_CHUNK", 1000)
    monkeypatch.setattr(ar, "SMALL_TENSOR", 300)
    gen = torch.Generator().manual_seed(0)
    counts = [5, 0, 2500, 299, 300, 1, 7, 1000, 3001, 0, 40, 40, 40]
    offsets = [sum(counts[:i]) for i in range(len(counts) + 1)]
    a_parts = [torch.randn(c, generator=gen, dtype=torch.float64).to(dtype) for c in counts]
    b_parts = [torch.randn(c, generator=gen, dtype=torch.float64).to(dtype) for c in counts]
    b_parts[0] = a_parts[0].clone()  # identical
    b_parts[3] = torch.zeros(counts[3], dtype=dtype)  # one side zero
    b_parts[6] = -a_parts[6]  # anti-parallel
    a = torch.cat(a_parts)
    b = torch.cat(b_parts)
    for low, high, parts in ((a, b, (a_parts, b_parts)), (b, a, (b_parts, a_parts))):
        out = low.clone()
        ar._local_pair(out, high, offsets)
        for i in range(len(counts)):
            expected = adasum(parts[0][i], parts[1][i])
            got = out[offsets[i] : offsets[i + 1]]
            assert rel_err(got, expected) <= REL_TOL[str(dtype)], (i, rel_err(got, expected))
        assert torch.equal(out[: offsets[1]], a_parts[0])  # identical: unchanged
        assert out[offsets[6] : offsets[7]].abs().max() == 0  # anti-parallel: cancel
        # one side zero: the other side unchanged
        assert torch.equal(out[offsets[3] : offsets[4]], a_parts[3])


def test_plan_covers_the_segment_in_order(monkeypatch):
    rng = random.Random(1)
    for _ in range(200):
        counts = [
            rng.choice([0, 1, 3, 50, 299, 300, 301, 999, 1000, 1001, 4000]) for _ in range(rng.randint(0, 12))
        ]
        chunk, small = 1000, 300
        monkeypatch.setattr(ar, "SMALL_TENSOR", small)
        plan = ar.plan_chunks(counts, chunk)
        position = 0
        seen: dict[int, int] = {}
        for start, stop, ids, lengths in plan:
            assert start == position and stop > start and sum(lengths) == stop - start
            assert len(ids) == len(lengths) and all(c > 0 for c in lengths)
            if len(ids) > 1 or counts[ids[0]] < small:  # a run of small tensors, each whole
                assert all(counts[i] < small and counts[i] == c for i, c in zip(ids, lengths, strict=True))
                assert stop - start < chunk + small
            else:  # a part of one large tensor
                assert stop - start <= chunk
            for i, c in zip(ids, lengths, strict=True):
                seen[i] = seen.get(i, 0) + c
            position = stop
        assert position == sum(counts)
        assert seen == {i: c for i, c in enumerate(counts) if c > 0}


def test_segment_counts():
    offsets = [0, 3, 3, 10, 12]  # tensors of 3, 0, 7, 2 elements
    assert ar._segment_counts(offsets, 0, 12) == [3, 0, 7, 2]
    assert ar._segment_counts(offsets, 2, 6) == [1, 0, 5, 0]
    assert ar._segment_counts(offsets, 10, 2) == [0, 0, 0, 2]
    assert ar._segment_counts(offsets, 5, 0) == [0, 0, 0, 0]


def test_float32_ulps_counts_representable_steps():
    x = torch.tensor([1.0, -3.5, 0.0, 1e-40, -0.0], dtype=torch.float32)
    up = torch.nextafter(x, torch.full_like(x, float("inf")))
    assert float32_ulps(x, up).tolist() == [1, 1, 1, 1, 1]
    assert float32_ulps(x, torch.nextafter(up, torch.full_like(x, float("inf")))).tolist() == [2] * 5
    assert float32_ulps(torch.tensor([0.0]), torch.tensor([-0.0])).tolist() == [0]


def test_norm_threshold_is_horovods():
    assert ADASUM_NORM_EPS == pytest.approx(1.4916681462400413e-154)


def test_the_flat_form_refuses_a_buffer_it_cannot_reduce(single_process_group):
    with pytest.raises(ValueError, match=r"needs a contiguous 1-D tensor, got shape \(2, 3\)"):
        ar.adasum_allreduce_flat(torch.zeros(2, 3), [6])
    with pytest.raises(ValueError, match="counts add up to 5, but the buffer holds 6 elements"):
        ar.adasum_allreduce_flat(torch.zeros(6), [2, 3])
    with pytest.raises(TypeError, match="element 0 is torch.int64"):
        ar.adasum_allreduce_flat(torch.zeros(6, dtype=torch.int64), [6])
    flat = torch.arange(6.0)
    assert ar.adasum_allreduce_flat(flat, [2, 4]) is flat and torch.equal(flat, torch.arange(6.0))
