"""Misuse refused on every rank before step 1, Adasum's hard cases, and faults — real horovodrun jobs.

The 2-rank fits are cases of one ``horovodrun -np 2`` launch (``tests/cases.py``); 3 ranks, a killed rank,
the Gloo controller and Gloo CPU operations are launches of their own (the launch is what they test).
"""

import time

import pytest
import torch

from adasum_lightning.horovod.support import (
    check_controller,
    check_cpu_operations,
    check_gradient_clipping,
    check_world_size,
)
from adasum_lightning.reference import adasum
from tests.cases import Launch, assert_refused_on_every_rank, case
from tests.helpers import (
    assert_every_rank_says,
    assert_ranks_identical,
    expected_message,
    run_horovod,
)
from tests.reference import local_delta, strip

pytestmark = pytest.mark.mpi

MPI2 = Launch("horovodrun", 2)
GLOO2 = Launch("horovodrun --gloo", 2)
GLOO_OPERATIONS2 = Launch("horovodrun", 2, env=(("HOROVOD_CPU_OPERATIONS", "gloo"),))


def fit(name: str, *args: str, launch: Launch = MPI2):
    return case(launch, name, "fit", *args)


# ---------------------------------------------------------------- refused at setup, on every rank
@pytest.mark.walltime
def test_three_processes_are_refused_quickly(tmp_path):
    start = time.monotonic()
    proc = run_horovod(3, "fit", str(tmp_path), check=False, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0 and elapsed < 60, (proc.returncode, elapsed)
    message = expected_message(check_world_size, 3)
    assert "this job has 3 processes. Launch 2 or 4 processes" in message
    assert_every_rank_says(proc.stdout + proc.stderr, 3, message)
    assert not list(tmp_path.glob("rank*.pt"))


GLOO_REFUSED = fit("gloo-controller-adasum", launch=GLOO2)
GLOO_AVERAGING = fit("gloo-controller-horovod", "--strategy", "horovod", launch=GLOO2)


@pytest.mark.cases(GLOO_REFUSED)
def test_gloo_controller_is_refused_for_adasum(cases):
    message = expected_message(check_controller, mpi_built=True, mpi_enabled=False, gloo_enabled=True)
    assert "needs the MPI controller, but this job runs under Gloo (horovodrun --gloo)" in message
    assert_refused_on_every_rank(cases[GLOO_REFUSED], message)


@pytest.mark.cases(GLOO_AVERAGING)
def test_gloo_controller_still_trains_with_averaging(cases):
    ranks = cases[GLOO_AVERAGING].ranks
    assert all(res["global_step"] == 16 for res in ranks)
    assert_ranks_identical(ranks)


GLOO_OPERATIONS = {s: fit(f"gloo-operations-{s}", "--strategy", s, launch=GLOO_OPERATIONS2) for s in
                   ("horovod_adasum", "horovod")}  # fmt: skip


@pytest.mark.parametrize(
    "strategy", [pytest.param(s, marks=pytest.mark.cases(c)) for s, c in GLOO_OPERATIONS.items()]
)
def test_gloo_cpu_operations_under_mpi_are_refused(strategy, cases):
    message = expected_message(
        check_cpu_operations, mpi_enabled=True, cpu_operations="gloo", strategy_name=strategy
    )
    assert_refused_on_every_rank(cases[GLOO_OPERATIONS[strategy]], message)


NORM_CLIPPING = fit("norm-clipping-refused", "--clip-value", "1.0")


@pytest.mark.cases(NORM_CLIPPING)
def test_norm_clipping_is_refused_on_every_rank(cases):
    message = expected_message(check_gradient_clipping, 1.0, None)
    assert "cannot clip gradients by norm (gradient_clip_val=1.0)" in message
    assert_refused_on_every_rank(cases[NORM_CLIPPING], message)


# ---------------------------------------------------------------- configurations that must train correctly
BF16 = fit("bf16-mixed", "--precision", "bf16-mixed")


@pytest.mark.cases(BF16)
def test_bf16_mixed_trains_identically(cases):
    ranks = cases[BF16].ranks
    assert all(res["global_step"] == 16 for res in ranks)
    assert_ranks_identical(ranks)
    assert not any(torch.equal(ranks[0]["start"][k], ranks[0]["end"][k]) for k in ranks[0]["end"])


FP32, FP16 = (
    fit("three-steps-fp32", "--max-steps", "3"),
    fit("three-steps-fp16", "--max-steps", "3", "--compression", "fp16"),
)


@pytest.mark.cases(FP32, FP16)
def test_fp16_compression_matches_fp32_within_fp16_tolerance(cases):
    a, b = cases[FP32].ranks, cases[FP16].ranks
    assert_ranks_identical(b)
    for name, tensor in a[0]["end"].items():
        change = (tensor - a[0]["start"][name]).abs().max().item()
        diff = (b[0]["end"][name] - tensor).abs().max().item()
        assert diff <= 2e-3 * max(change, 1.0), (name, diff, change)  # fp16 has ~3 decimal digits
    assert any(not torch.equal(b[0]["end"][k], a[0]["end"][k]) for k in a[0]["end"])  # fp16 really was used


LR, CLIP, SCALE = 1.0, 0.001, 1e4  # a huge loss: unclipped deltas would be ~1e4 larger
VALUE_CLIPPING = fit("value-clipping", "--max-steps", "1", "--lr", str(LR), "--loss-scale", str(SCALE),
                     "--clip-value", str(CLIP), "--clip-algorithm", "value")  # fmt: skip


@pytest.mark.cases(VALUE_CLIPPING)
def test_value_clipping_takes_effect_before_the_local_step(cases):
    lr, clip, scale = LR, CLIP, SCALE
    ranks = cases[VALUE_CLIPPING].ranks
    start = strip(ranks[0]["start"])
    deltas = [
        local_delta(start, res["batches"][:1], lr=lr, loss_scale=scale, clip_value=clip) for res in ranks
    ]
    for res in ranks:
        for name, end in strip(res["end"]).items():
            expected = start[name] + adasum(deltas[0][name], deltas[1][name])
            assert torch.allclose(end, expected, rtol=1e-5, atol=1e-7), (name, (end - expected).abs().max())
            assert (
                end - start[name]
            ).abs().max().item() <= 2 * lr * clip + 1e-7  # two clipped deltas at most


ZERO_UPDATE = fit("zero-update-rank-0", "--max-steps", "1", "--lr", "0.1", "--zero-loss-rank", "0")


@pytest.mark.cases(ZERO_UPDATE)
def test_zero_update_on_one_rank_gives_the_other_ranks_update(cases):
    lr = 0.1
    ranks = cases[ZERO_UPDATE].ranks
    start = strip(ranks[0]["start"])
    delta1 = local_delta(start, ranks[1]["batches"][:1], lr=lr)
    for res in ranks:
        for name, end in strip(res["end"]).items():
            assert not torch.isnan(end).any()
            assert torch.allclose(end, start[name] + delta1[name], rtol=1e-6, atol=1e-7), name


FROZEN = fit("frozen-branch", "--model", "frozen_branch", "--epochs", "2")


@pytest.mark.cases(FROZEN)
def test_frozen_parameters_and_parameters_without_gradient(cases):
    ranks = cases[FROZEN].ranks
    assert_ranks_identical(ranks)
    for res in ranks:
        for name in ("frozen.weight", "frozen.bias"):
            assert torch.equal(res["end"][name], res["start"][name])  # frozen stays frozen
        used = res["branch_used"]
        assert any(used) and not all(used)  # the branch got no gradient on some steps
    # …and on some steps only one of the two ranks used it
    assert ranks[0]["branch_used"] != ranks[1]["branch_used"]
    assert not torch.equal(ranks[0]["end"]["branch.weight"], ranks[0]["start"]["branch.weight"])


TWO_OPTIMIZERS = fit("two-optimizers", "--model", "two_optimizers", "--epochs", "2")


@pytest.mark.compat_oldest
@pytest.mark.cases(TWO_OPTIMIZERS)
def test_two_optimizers_with_manual_optimization(cases):
    ranks = cases[TWO_OPTIMIZERS].ranks
    assert_ranks_identical(ranks)
    assert all(res["global_step"] == 32 for res in ranks)  # 8 batches × 2 epochs × 2 optimizer steps
    for name in ("net.0.weight", "head.weight"):
        assert not torch.equal(ranks[0]["end"][name], ranks[0]["start"][name])


ACCUMULATION = fit("accumulate-3-one-step", "--max-steps", "1", "--lr", "0.1", "--accumulate", "3")


@pytest.mark.cases(ACCUMULATION)
def test_accumulation_window_is_one_local_step_then_one_reduction(cases):
    lr = 0.1
    ranks = cases[ACCUMULATION].ranks
    start = strip(ranks[0]["start"])
    deltas = [local_delta(start, res["batches"][:3], lr=lr) for res in ranks]
    for res in ranks:
        assert res["global_step"] == 1 and len(res["indices"]) == 3 * 4  # three micro-batches of 4
        for name, end in strip(res["end"]).items():
            expected = start[name] + adasum(deltas[0][name], deltas[1][name])
            assert torch.allclose(end, expected, rtol=1e-5, atol=1e-7), (name, (end - expected).abs().max())


PARTIAL_WINDOW = fit("accumulate-3-partial-window", "--samples", "80", "--epochs", "3", "--accumulate", "3")


@pytest.mark.compat_oldest
@pytest.mark.cases(PARTIAL_WINDOW)
def test_accumulation_partial_window_at_epoch_end(cases):
    # 80 samples / 2 ranks / batch 4 = 10 batches per epoch = windows of 3 + 3 + 3 + 1.
    ranks = cases[PARTIAL_WINDOW].ranks
    assert_ranks_identical(ranks)
    for res in ranks:
        assert res["global_step"] == 12  # 4 steps per epoch: the partial window is stepped, not carried over
        # every epoch starts with full countdowns (3) and no pending reduction
        assert res["epoch_start_delays"] == [([3], 0)] * 3


SCHEDULER = fit("step-scheduler", "--scheduler", "step", "--epochs", "3", "--lr", "0.2")


@pytest.mark.cases(SCHEDULER)
def test_schedulers_step_alike_and_are_not_scaled(cases):
    ranks = cases[SCHEDULER].ranks
    for res in ranks:
        assert res["base_lrs"] == [pytest.approx(0.2)]
        assert res["lrs"] == [pytest.approx(0.2)] * 8 + [pytest.approx(0.1)] * 8 + [pytest.approx(0.05)] * 8
    assert_ranks_identical(ranks)


# ---------------------------------------------------------------- faults
@pytest.mark.walltime
def test_a_killed_rank_ends_the_job_quickly(tmp_path):
    start = time.monotonic()
    proc = run_horovod(
        2,
        "fit",
        str(tmp_path),
        "--epochs",
        "50",
        "--kill-rank",
        "1",
        "--kill-at-step",
        "5",
        check=False,
        timeout=120,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert elapsed < 60, elapsed
    assert not list(tmp_path.glob("rank*.pt"))  # neither rank finished
