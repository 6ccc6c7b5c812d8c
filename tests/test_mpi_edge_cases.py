"""Misuse refused on every rank before step 1, Adasum's hard cases, and faults — real horovodrun jobs."""

import time

import pytest
import torch

from adasum_lightning.ops import adasum
from adasum_lightning.validation import (
    check_controller,
    check_cpu_operations,
    check_gradient_clipping,
    check_world_size,
)
from tests.helpers import (
    assert_every_rank_says,
    assert_ranks_identical,
    expected_message,
    load_ranks,
    run_horovod,
)
from tests.workers.tiny import tiny_net  # noqa: E402

pytestmark = pytest.mark.mpi


# ---------------------------------------------------------------- refused at setup, on every rank
def test_three_processes_are_refused_quickly(tmp_path):
    start = time.monotonic()
    proc = run_horovod(3, "fit", str(tmp_path), check=False, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0 and elapsed < 60, (proc.returncode, elapsed)
    message = expected_message(check_world_size, 3)
    assert "this job has 3 processes. Launch 2 or 4 processes" in message
    assert_every_rank_says(proc, 3, message)
    assert not list(tmp_path.glob("rank*.pt"))


def test_gloo_controller_is_refused_for_adasum(tmp_path):
    proc = run_horovod(2, "fit", str(tmp_path), gloo=True, check=False, timeout=120)
    assert proc.returncode != 0
    message = expected_message(check_controller, mpi_built=True, mpi_enabled=False, gloo_enabled=True)
    assert "needs the MPI controller, but this job runs under Gloo (horovodrun --gloo)" in message
    assert_every_rank_says(proc, 2, message)


def test_gloo_controller_still_trains_with_averaging(tmp_path):
    run_horovod(2, "fit", str(tmp_path), "--strategy", "horovod", gloo=True)
    ranks = load_ranks(tmp_path, 2)
    assert all(res["global_step"] == 16 for res in ranks)
    assert_ranks_identical(ranks)


@pytest.mark.parametrize("strategy", ["horovod_adasum", "horovod"])
def test_gloo_cpu_operations_under_mpi_are_refused(strategy, tmp_path, monkeypatch):
    monkeypatch.setenv("HOROVOD_CPU_OPERATIONS", "gloo")
    proc = run_horovod(2, "fit", str(tmp_path), "--strategy", strategy, check=False, timeout=120)
    assert proc.returncode != 0
    message = expected_message(
        check_cpu_operations, mpi_enabled=True, cpu_operations="gloo", strategy_name=strategy
    )
    assert_every_rank_says(proc, 2, message)


def test_norm_clipping_is_refused_on_every_rank(tmp_path):
    proc = run_horovod(2, "fit", str(tmp_path), "--clip-value", "1.0", check=False, timeout=120)
    assert proc.returncode != 0
    message = expected_message(check_gradient_clipping, 1.0, None)
    assert "cannot clip gradients by norm (gradient_clip_val=1.0)" in message
    assert_every_rank_says(proc, 2, message)


# ---------------------------------------------------------------- configurations that must train correctly
def local_sgd_delta(start, batches, lr, momentum=0.5, loss_scale=1.0, clip_value=None):
    """One local SGD step of the tiny net from ``start`` on the mean loss of ``batches`` (Lightning divides
    each micro-batch's loss by their number); returns {name: delta}."""
    net = tiny_net()
    net.load_state_dict(start)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    for x, y in batches:
        (torch.nn.functional.cross_entropy(net(x), y) * loss_scale / len(batches)).backward()
    if clip_value is not None:
        torch.nn.utils.clip_grad_value_(net.parameters(), clip_value)
    opt.step()
    return {k: v.detach() - start[k] for k, v in net.state_dict().items()}


def strip(state):
    return {k.removeprefix("net."): v for k, v in state.items()}


def test_bf16_mixed_trains_identically(tmp_path):
    run_horovod(2, "fit", str(tmp_path), "--precision", "bf16-mixed")
    ranks = load_ranks(tmp_path, 2)
    assert all(res["global_step"] == 16 for res in ranks)
    assert_ranks_identical(ranks)
    assert not any(torch.equal(ranks[0]["start"][k], ranks[0]["end"][k]) for k in ranks[0]["end"])


def test_fp16_compression_matches_fp32_within_fp16_tolerance(tmp_path):
    fp32, fp16 = tmp_path / "fp32", tmp_path / "fp16"
    fp32.mkdir(), fp16.mkdir()
    run_horovod(2, "fit", str(fp32), "--max-steps", "3")
    run_horovod(2, "fit", str(fp16), "--max-steps", "3", "--compression", "fp16")
    a, b = load_ranks(fp32, 2), load_ranks(fp16, 2)
    assert_ranks_identical(b)
    for name, tensor in a[0]["end"].items():
        change = (tensor - a[0]["start"][name]).abs().max().item()
        diff = (b[0]["end"][name] - tensor).abs().max().item()
        assert diff <= 2e-3 * max(change, 1.0), (name, diff, change)  # fp16 has ~3 decimal digits
    assert any(not torch.equal(b[0]["end"][k], a[0]["end"][k]) for k in a[0]["end"])  # fp16 really was used


def test_value_clipping_takes_effect_before_the_local_step(tmp_path):
    lr, clip, scale = 1.0, 0.001, 1e4  # a huge loss: unclipped deltas would be ~1e4 larger
    run_horovod(
        2,
        "fit",
        str(tmp_path),
        "--max-steps",
        "1",
        "--lr",
        str(lr),
        "--loss-scale",
        str(scale),
        "--clip-value",
        str(clip),
        "--clip-algorithm",
        "value",
    )
    ranks = load_ranks(tmp_path, 2)
    start = strip(ranks[0]["start"])
    deltas = [
        local_sgd_delta(start, res["batches"][:1], lr, loss_scale=scale, clip_value=clip) for res in ranks
    ]
    for res in ranks:
        for name, end in strip(res["end"]).items():
            expected = start[name] + adasum(deltas[0][name], deltas[1][name])
            assert torch.allclose(end, expected, rtol=1e-5, atol=1e-7), (name, (end - expected).abs().max())
            assert (
                end - start[name]
            ).abs().max().item() <= 2 * lr * clip + 1e-7  # two clipped deltas at most


def test_zero_update_on_one_rank_gives_the_other_ranks_update(tmp_path):
    lr = 0.1
    run_horovod(2, "fit", str(tmp_path), "--max-steps", "1", "--lr", str(lr), "--zero-loss-rank", "0")
    ranks = load_ranks(tmp_path, 2)
    start = strip(ranks[0]["start"])
    delta1 = local_sgd_delta(start, ranks[1]["batches"][:1], lr)
    for res in ranks:
        for name, end in strip(res["end"]).items():
            assert not torch.isnan(end).any()
            assert torch.allclose(end, start[name] + delta1[name], rtol=1e-6, atol=1e-7), name


def test_frozen_parameters_and_parameters_without_gradient(tmp_path):
    run_horovod(2, "fit", str(tmp_path), "--model", "frozen_branch", "--epochs", "2")
    ranks = load_ranks(tmp_path, 2)
    assert_ranks_identical(ranks)
    for res in ranks:
        for name in ("frozen.weight", "frozen.bias"):
            assert torch.equal(res["end"][name], res["start"][name])  # frozen stays frozen
        used = res["branch_used"]
        assert any(used) and not all(used)  # the branch got no gradient on some steps
    # …and on some steps only one of the two ranks used it
    assert ranks[0]["branch_used"] != ranks[1]["branch_used"]
    assert not torch.equal(ranks[0]["end"]["branch.weight"], ranks[0]["start"]["branch.weight"])


@pytest.mark.compat_oldest
def test_two_optimizers_with_manual_optimization(tmp_path):
    run_horovod(2, "fit", str(tmp_path), "--model", "two_optimizers", "--epochs", "2")
    ranks = load_ranks(tmp_path, 2)
    assert_ranks_identical(ranks)
    assert all(res["global_step"] == 32 for res in ranks)  # 8 batches × 2 epochs × 2 optimizer steps
    for name in ("net.0.weight", "head.weight"):
        assert not torch.equal(ranks[0]["end"][name], ranks[0]["start"][name])


def test_accumulation_window_is_one_local_step_then_one_reduction(tmp_path):
    lr = 0.1
    run_horovod(2, "fit", str(tmp_path), "--max-steps", "1", "--lr", str(lr), "--accumulate", "3")
    ranks = load_ranks(tmp_path, 2)
    start = strip(ranks[0]["start"])
    deltas = [local_sgd_delta(start, res["batches"][:3], lr) for res in ranks]
    for res in ranks:
        assert res["global_step"] == 1 and len(res["indices"]) == 3 * 4  # three micro-batches of 4
        for name, end in strip(res["end"]).items():
            expected = start[name] + adasum(deltas[0][name], deltas[1][name])
            assert torch.allclose(end, expected, rtol=1e-5, atol=1e-7), (name, (end - expected).abs().max())


@pytest.mark.compat_oldest
def test_accumulation_partial_window_at_epoch_end(tmp_path):
    # 80 samples / 2 ranks / batch 4 = 10 batches per epoch = windows of 3 + 3 + 3 + 1.
    run_horovod(2, "fit", str(tmp_path), "--samples", "80", "--epochs", "3", "--accumulate", "3")
    ranks = load_ranks(tmp_path, 2)
    assert_ranks_identical(ranks)
    for res in ranks:
        assert res["global_step"] == 12  # 4 steps per epoch: the partial window is stepped, not carried over
        # every epoch starts with full countdowns (3) and no pending reduction
        assert res["epoch_start_delays"] == [([3], 0)] * 3


def test_schedulers_step_alike_and_are_not_scaled(tmp_path):
    run_horovod(2, "fit", str(tmp_path), "--scheduler", "step", "--epochs", "3", "--lr", "0.2")
    ranks = load_ranks(tmp_path, 2)
    for res in ranks:
        assert res["base_lrs"] == [pytest.approx(0.2)]
        assert res["lrs"] == [pytest.approx(0.2)] * 8 + [pytest.approx(0.1)] * 8 + [pytest.approx(0.05)] * 8
    assert_ranks_identical(ranks)


# ---------------------------------------------------------------- faults
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
