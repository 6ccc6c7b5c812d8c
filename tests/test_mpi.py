"""Real multi-process runs under horovodrun (Open MPI, CPU), cases of one launch per world size
(``tests/cases.py``): every rank's result is checked."""

import pytest
import torch

from tests.cases import Launch, case
from tests.helpers import assert_ranks_identical
from tests.reference import assert_one_step_is_the_adasum_of_local_deltas, local_delta, strip

pytestmark = pytest.mark.mpi


COLLECTIVES = {np: case(Launch("horovodrun", np), f"collectives-{np}", "collectives") for np in (2, 4)}


@pytest.mark.parametrize(
    "np", [pytest.param(np, marks=pytest.mark.cases(c)) for np, c in COLLECTIVES.items()]
)
def test_adasum_allreduce_equals_the_reference(np, cases):
    ranks = cases[COLLECTIVES[np]].ranks
    for r, res in enumerate(ranks):
        assert (res["rank"], res["size"]) == (r, np)
        for (dtype, shape), diff in res["adasum"].items():
            if dtype == "torch.float64":
                assert diff["max_abs"] <= 1e-12, (r, shape, diff)
            else:
                assert diff["rel"] <= 1e-5, (r, shape, diff)
        assert torch.equal(res["orthogonal"], torch.ones(np, dtype=torch.float64))  # orthogonal: the sum
        assert torch.equal(res["identical"], torch.arange(4, dtype=torch.float64))  # identical: unchanged
        assert not torch.isnan(res["zero_rank0"]).any()
        # strategy collectives: ranks hold 1..np
        assert res["reduce_mean"].item() == pytest.approx((np + 1) / 2)
        assert res["reduce_sum"].item() == np * (np + 1) / 2
        assert res["reduce_max"].item() == np
        assert torch.equal(res["all_gather"], torch.tensor([[i, 10 * i] for i in range(np)]))
        assert res["broadcast"] == {"from": np - 1, "list": [np - 1] * 3}
        assert (res["global_rank"], res["world_size"]) == (r, np)
    # With 2 ranks the "one zero update" case returns the other rank's update exactly.
    if np == 2:
        assert torch.equal(ranks[0]["zero_rank0"], torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))


def assert_disjoint_shards(ranks, n, epochs):
    per_epoch = n // len(ranks)
    for e in range(epochs):
        seen = [set(res["indices"][e * per_epoch : (e + 1) * per_epoch]) for res in ranks]
        assert sum(len(s) for s in seen) == n, f"epoch {e}: shards overlap"
        assert set().union(*seen) == set(range(n)), f"epoch {e}: samples missing"


def fit(name: str, np: int, *args: str):
    return case(Launch("horovodrun", np), name, "fit", *args)


ONECYCLE = fit("horovod_adasum-onecycle", 2, "--epochs", "2", "--scheduler", "onecycle")


@pytest.mark.compat
@pytest.mark.cases(ONECYCLE)
def test_fit_two_ranks_identical_parameters_and_own_shards(cases):
    ranks = cases[ONECYCLE].ranks
    assert_ranks_identical(
        ranks, "start"
    )  # rank 0's initial weights were broadcast (ranks seeded differently)
    assert_ranks_identical(ranks, "end")
    assert all(res["global_step"] == 16 for res in ranks)  # 64 samples / 2 ranks / batch 4 × 2 epochs
    assert all(res["optimizer_class"] == "SGD/horovod.torch.optimizer" for res in ranks)
    assert_disjoint_shards(ranks, n=64, epochs=2)
    # The schedule stepped identically on both ranks.
    assert ranks[0]["lrs"] == ranks[1]["lrs"] and ranks[0]["lrs"][0] < ranks[0]["lrs"][-1]


FOUR_RANKS = {s: fit(f"{s}-4-step-scheduler", 4, "--strategy", s, "--lr", "0.05", "--scheduler", "step")
              for s in ("horovod_adasum", "horovod")}  # fmt: skip


@pytest.mark.compat
@pytest.mark.parametrize(
    ("strategy", "factor"),
    [
        pytest.param(s, f, marks=pytest.mark.cases(FOUR_RANKS[s]))
        for s, f in (("horovod_adasum", 1), ("horovod", 4))
    ],
)
def test_four_ranks_learning_rate_and_identical_parameters(strategy, factor, cases):
    ranks = cases[FOUR_RANKS[strategy]].ranks
    for res in ranks:
        assert res["world_size"] == 4
        assert res["start_lr"] == pytest.approx(0.05 * factor)
        assert res["base_lrs"] == [pytest.approx(0.05 * factor)]
        # 2 epochs × 4 steps; StepLR halves the rate after each epoch, from the scaled base
        assert res["lrs"] == [pytest.approx(0.05 * factor)] * 4 + [pytest.approx(0.025 * factor)] * 4
    assert_ranks_identical(ranks, "end")
    assert_disjoint_shards(ranks, n=64, epochs=2)


ONE_STEP = fit("horovod_adasum-one-step", 2, "--max-steps", "1", "--lr", "0.1")


@pytest.mark.compat
@pytest.mark.cases(ONE_STEP)
def test_one_step_is_the_adasum_of_the_local_sgd_deltas(cases):
    ranks = cases[ONE_STEP].ranks
    start = strip(ranks[0]["start"])
    deltas = [local_delta(start, res["batches"][:1]) for res in ranks]  # lr 0.1, momentum 0.5
    assert not torch.equal(ranks[0]["batches"][0][0], ranks[1]["batches"][0][0])
    assert_one_step_is_the_adasum_of_local_deltas(ranks, deltas)
    for (
        res
    ) in ranks:  # and it is neither the sum nor the mean of the deltas (neither orthogonal nor parallel)
        for name, end in strip(res["end"]).items():
            assert not torch.allclose(
                end, start[name] + deltas[0][name] + deltas[1][name], rtol=1e-5, atol=1e-7
            )


ONECYCLE_RESUMED = fit("horovod_adasum-onecycle-resumed", 2, "--epochs", "3", "--scheduler", "onecycle",
                       "--ckpt-path", f"{{{ONECYCLE.name}}}")  # fmt: skip


@pytest.mark.compat
@pytest.mark.cases(ONECYCLE, ONECYCLE_RESUMED)
def test_resume_restores_the_schedule_and_every_ranks_own_optimizer_state(cases):
    ckpts = sorted((cases[ONECYCLE].out / "checkpoints").glob("*.ckpt"))
    assert [c.name for c in ckpts] == ["epoch=1-step=16.ckpt"]
    ckpt = torch.load(ckpts[0], weights_only=False)
    ranks = cases[ONECYCLE_RESUMED].ranks
    # rank 0's state in the checkpoint, rank 1's beside it (tests/test_resume.py has the rest)
    rank1 = torch.load(f"{ckpts[0]}.rank1-optimizer.pt", weights_only=False)
    saved_states = [ckpt["optimizer_states"][0]["state"], rank1["optimizer_states"][0]["state"]]
    for res, saved_state in zip(ranks, saved_states, strict=True):
        assert res["global_step_start"] == 16 and res["global_step"] == 24
        for name, tensor in ckpt["state_dict"].items():
            assert torch.equal(res["start"][name], tensor), name
        assert res["start_opt_state"].keys() == saved_state.keys()
        for k, buffers in res["start_opt_state"].items():
            assert torch.equal(buffers["momentum_buffer"], saved_state[k]["momentum_buffer"])
        assert res["lrs"][0] == pytest.approx(ckpt["lr_schedulers"][0]["_last_lr"][0])
    assert_ranks_identical(ranks, "end")
