"""``Fabric(strategy="horovod_adasum")`` and ``Fabric(strategy="horovod")`` in real ``horovodrun`` jobs.

Few jobs, many scenarios: each job runs several Fabric set-ups one after the other
(``tests/workers/fabric_horovod.py``), and every rank's records are checked against references computed
here in one process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from adasum_lightning.horovod.support import (
    check_closure_optimizers,
    check_controller,
    check_cpu_operations,
    check_gradient_predivide_factor,
    check_launch,
    check_precision,
    check_skipped_backward_passes,
    check_world_size,
    clipping_refused,
)
from tests.cases import Launch, case
from tests.helpers import (
    assert_every_rank_says,
    expected_message,
    load_ranks,
    plain_env,
    run_job,
)
from tests.reference import assert_one_step_is_the_adasum_of_local_deltas, local_delta
from tests.workers.samples import tiny_net

pytestmark = pytest.mark.mpi

WORKER = "fabric_horovod"
LR, MOMENTUM = 0.1, 0.5


#: The training scenarios, then the refusals, as one case of the 2-rank launch (``tests/cases.py``).
TWO_RANKS = case(Launch("horovodrun", 2), "fabric-horovod-train-refusals", WORKER, "--jobs", "train,refusals",
                 timeout=180)  # fmt: skip


@pytest.fixture
def two_ranks(cases) -> tuple[str, list[dict], Path]:
    """The case's output, every rank's records and its folder."""
    result = cases[TWO_RANKS]
    return result.case_output, result.ranks, result.out


def assert_identical(ranks: list[dict], scenario: str, key: str = "end") -> None:
    for r, res in enumerate(ranks[1:], start=1):
        for name, tensor in ranks[0][scenario][key].items():
            assert torch.equal(tensor, res[scenario][key][name]), (scenario, key, name, r)


def gradient(start: dict, batch) -> dict:
    """The tiny net's gradient of the mean loss of one batch at ``start``."""
    net = tiny_net()
    net.load_state_dict(start)
    x, y = batch
    F.cross_entropy(net(x), y).backward()
    return {name: p.grad for name, p in net.named_parameters()}


# ---------------------------------------------------------------- horovod_adasum, each form and package
@pytest.mark.parametrize("package", ["lightning_fabric", "lightning.fabric"])
@pytest.mark.parametrize("by", ["name", "instance"])
@pytest.mark.cases(TWO_RANKS)
def test_horovod_adasum_one_step_is_the_adasum_of_the_local_deltas(two_ranks, package, by):
    _, ranks, _ = two_ranks
    scenario = f"adasum/{package}/{by}"
    records = [res[scenario] for res in ranks]
    copy = "adasum_lightning" if package == "lightning_fabric" else "adasum_lightning.lightning"
    for res in records:
        assert res["strategy"] == f"{copy}.horovod.fabric.HorovodAdasumStrategy"
        assert f"{package}.strategies.ddp.DDPStrategy" in res["base"]
        assert res["world_size"] == 2 and res["lr"] == pytest.approx(LR)  # no learning-rate scaling
        assert res["all_gather"] == [1.0, 2.0] and res["all_reduce_sum"] == 3.0
        assert res["all_reduce_mean"] == 1.5 and res["broadcast"] == "from rank 0"
        for name, tensor in records[0]["init"].items():  # every rank starts from rank 0's weights
            assert torch.equal(res["start"][name], tensor), name
    assert not torch.equal(records[0]["init"]["0.weight"], records[1]["init"]["0.weight"])
    assert set(records[0]["indices"]).isdisjoint(records[1]["indices"])  # one sampler seed, own shards
    assert_identical(ranks, scenario)
    start = records[0]["start"]
    deltas = [local_delta(start, res["batches"]) for res in records]
    assert_one_step_is_the_adasum_of_local_deltas(records, deltas)
    mean = start["0.weight"] + (deltas[0]["0.weight"] + deltas[1]["0.weight"]) / 2
    assert not torch.allclose(records[0]["end"]["0.weight"], mean, rtol=1e-5, atol=1e-7)  # not averaging


@pytest.mark.cases(TWO_RANKS)
def test_no_backward_sync_accumulates_with_backward_passes_per_step(two_ranks):
    _, ranks, _ = two_ranks
    records = [res["adasum/accumulate"] for res in ranks]
    assert all(len(res["batches"]) == 2 for res in records)
    assert_identical(ranks, "adasum/accumulate")
    # the local step on the sum of both halves' gradients, then the Adasum of the two ranks' deltas
    deltas = [local_delta(records[0]["start"], res["batches"]) for res in records]
    assert_one_step_is_the_adasum_of_local_deltas(records, deltas)


@pytest.mark.cases(TWO_RANKS)
def test_save_on_rank_zero_and_load_on_every_rank(two_ranks):
    _, ranks, out = two_ranks
    records = [res["adasum/save_load"] for res in ranks]
    assert (out / "fabric.ckpt").is_file()
    saved = records[0]
    # each rank kept its own momentum (from its own gradients); the checkpoint holds rank 0's
    assert not torch.equal(saved["saved_momentum"][0], records[1]["saved_momentum"][0])
    for res in records:
        assert res["loaded_step"] == 1
        for name, tensor in saved["end"].items():
            assert torch.equal(res["loaded"][name], tensor), name
        for index, buffer in saved["saved_momentum"].items():
            assert torch.equal(res["loaded_momentum"][index], buffer), index


# ---------------------------------------------------------------- horovod: averaging, lr × world size
@pytest.mark.cases(TWO_RANKS)
def test_horovod_averages_the_gradients_with_the_learning_rate_times_the_world_size(two_ranks):
    _, ranks, _ = two_ranks
    records = [res["horovod"] for res in ranks]
    assert all(res["lr"] == pytest.approx(2 * LR) for res in records)
    assert all(res["strategy"].endswith("horovod.fabric.HorovodStrategy") for res in records)
    assert_identical(ranks, "horovod")
    start = records[0]["start"]
    deltas = [local_delta(start, res["batches"], lr=2 * LR) for res in records]
    for res in records:
        for name, end in res["end"].items():
            expected = start[name] + (deltas[0][name] + deltas[1][name]) / 2
            assert torch.allclose(end, expected, rtol=1e-5, atol=1e-7), name


@pytest.mark.cases(TWO_RANKS)
def test_horovod_clips_the_averaged_gradients(two_ranks):
    _, ranks, _ = two_ranks
    records = [res["horovod/clip"] for res in ranks]
    assert_identical(ranks, "horovod/clip")
    start = records[0]["start"]
    grads = [gradient(start, res["batches"][0]) for res in records]
    mean = {name: (grads[0][name] + grads[1][name]) / 2 for name in start}
    total = torch.cat([g.flatten() for g in mean.values()]).norm().item()
    local = torch.cat([g.flatten() for g in grads[0].values()]).norm().item()
    assert total > 0.05 and abs(local - total) > 1e-3  # clipping applies, and the norm is the average's
    for res in records:
        assert res["norm"] == pytest.approx(total, rel=1e-5)
        for name, end in res["end"].items():
            expected = start[name] - 2 * LR * mean[name] * (0.05 / (total + 1e-6))
            assert torch.allclose(end, expected, rtol=1e-5, atol=1e-7), name


@pytest.mark.cases(TWO_RANKS)
def test_horovod_averages_each_closure_evaluation_of_lbfgs(two_ranks):
    _, ranks, _ = two_ranks
    records = [res["horovod/lbfgs"] for res in ranks]
    assert_identical(ranks, "horovod/lbfgs")
    # the same as LBFGS in one process on the mean of the two ranks' losses, with the learning rate × 2
    net = tiny_net()
    net.load_state_dict(records[0]["start"])
    opt = torch.optim.LBFGS(net.parameters(), lr=2 * 0.25, max_iter=3)

    def closure():
        opt.zero_grad()
        loss = sum(F.cross_entropy(net(x), y) for res in records for x, y in res["batches"]) / 2
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert all(res["loss"] == pytest.approx(loss.item(), rel=1e-5) for res in records)  # the averaged loss
    for name, expected in net.state_dict().items():
        assert torch.allclose(records[0]["end"][name], expected, rtol=1e-4, atol=1e-6), name


# ---------------------------------------------------------------- refused on every rank, before any step
REFUSALS = {
    "predivide": (check_gradient_predivide_factor, 2.0),
    "fp16": (check_precision, "16-mixed"),
    "lbfgs": (check_closure_optimizers, "horovod_adasum", ["LBFGS"]),
    "sync/adasum": (check_skipped_backward_passes, "horovod_adasum", "HorovodAdasumStrategy", 1, 1),
    "sync/horovod": (check_skipped_backward_passes, "horovod", "HorovodStrategy", 2, 2),
}


@pytest.mark.parametrize("scenario", list(REFUSALS))
@pytest.mark.cases(TWO_RANKS)
def test_refused_on_every_rank_before_the_first_step(two_ranks, scenario):
    output, ranks, _ = two_ranks
    rule, *rule_args = REFUSALS[scenario]
    message = expected_message(rule, *rule_args)
    assert_every_rank_says(output, 2, message)
    for res in ranks:
        assert res[scenario]["message"] == message and "stepped" not in res[scenario]
    if "after" in ranks[0][scenario]:  # set up (rank 0's weights everywhere), never stepped
        assert_identical(ranks, scenario, "after")
        if "start" in ranks[0][scenario]:
            assert all(
                torch.equal(ranks[0][scenario]["start"][n], t) for n, t in ranks[0][scenario]["after"].items()
            )


@pytest.mark.parametrize(
    ("scenario", "algorithm", "value"), [("clip/norm", "norm", 1.0), ("clip/value", "value", 0.5)]
)
@pytest.mark.cases(TWO_RANKS)
def test_clipping_under_adasum_is_refused_at_the_call(two_ranks, scenario, algorithm, value):
    output, ranks, _ = two_ranks
    message = str(clipping_refused("horovod_adasum", algorithm, value))
    assert "Use Fabric(strategy='ddp_adasum')" in message
    assert_every_rank_says(output, 2, message)
    assert all(res[scenario]["message"] == message and "stepped" not in res[scenario] for res in ranks)


WORLD = case(Launch("horovodrun", 3), "fabric-horovod-world", WORKER, "--jobs", "world")
GLOO = case(Launch("horovodrun --gloo", 2), "fabric-horovod-gloo", WORKER, "--jobs", "gloo")


@pytest.mark.cases(WORLD)
def test_a_world_size_not_a_power_of_two_is_refused(cases):
    result = cases[WORLD]
    message = expected_message(check_world_size, 3)
    assert_every_rank_says(result.case_output, 3, message)
    assert all(res["world"]["message"] == message for res in result.ranks)


@pytest.mark.cases(GLOO)
def test_the_gloo_controller_refuses_adasum_and_averaging_trains(cases):
    message = expected_message(check_controller, mpi_built=True, mpi_enabled=False, gloo_enabled=True)
    assert_every_rank_says(cases[GLOO].case_output, 2, message)
    ranks = cases[GLOO].ranks
    assert all(res["controller"]["message"] == message for res in ranks)
    assert_identical(ranks, "horovod")
    assert not torch.equal(ranks[0]["horovod"]["start"]["0.weight"], ranks[0]["horovod"]["end"]["0.weight"])


def test_a_process_horovod_sees_alone_and_gloo_cpu_operations_are_refused(tmp_path):
    # a plain `python` start with devices=2, then devices=1 with HOROVOD_CPU_OPERATIONS=gloo (MPI controller)
    cmd = [sys.executable, "-m", f"tests.workers.{WORKER}", str(tmp_path), "--jobs", "alone"]
    proc = run_job(cmd, plain_env(), timeout=120)
    output = proc.stdout + proc.stderr
    (res,) = load_ranks(tmp_path, 1)
    launch = expected_message(check_launch, 1, None, 2, api="Fabric", strategy_name="horovod_adasum")
    assert_every_rank_says(output, 1, launch)
    assert res["launch"]["message"] == launch
    for strategy in ("horovod_adasum", "horovod"):
        operations = expected_message(
            check_cpu_operations, mpi_enabled=True, cpu_operations="gloo", strategy_name=strategy
        )
        assert_every_rank_says(output, 1, operations)
        assert res[f"cpu_operations/{strategy}"]["message"] == operations
