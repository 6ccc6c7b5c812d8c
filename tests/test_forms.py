"""The three forms of Adasum on one core: ``AdasumOptimizer`` in a plain loop (``torchrun``),
``Fabric(strategy="ddp_adasum")`` (``fabric.launch()``) and ``Trainer(strategy="ddp_adasum")`` (Lightning's
launcher) train the same model on the same shards to the same parameters.

Every test reads real processes (``tests/workers/forms.py``, cases of a few launches: ``tests/cases.py``)
and checks every rank. Equality is bitwise: the three forms run the same arithmetic (Lightning's closure,
Fabric's precision plugin and the plain loop compute the same loss, gradients, clipping, unscaling and local
step; the reduction is the same function).
"""

from __future__ import annotations

import functools
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

from adasum_lightning.launch_environment import check_launcher_world_size
from adasum_lightning.optimizer import identical_gradients_message
from adasum_lightning.replicas import check_module_unwrapped
from tests.cases import Launch, assert_refused_on_every_rank, case
from tests.helpers import (
    ROOT,
    expected_message,
    load_ranks,
    mpi_env,
    plain_env,
    run_as_pytorch_job,
    run_job,
)
from tests.reference import (
    assert_one_step_is_the_adasum_of_local_deltas,
    local_delta,
    overlapped_local_sgd_reference,
)
from tests.workers.lightning import PACKAGE
from tests.workers.samples import IndexedData

pytestmark = pytest.mark.mpi

#: The Fabric package of the Lightning package under test (make test-compat runs each).
FABRIC = "lightning_fabric" if PACKAGE == "pytorch_lightning" else "lightning.fabric"


def form(name: str, kind: str, np: int, *args: str, fabric: str = FABRIC):
    """One form on ``np`` processes: the plain loop under torchrun, Fabric and Trainer under Lightning."""
    if kind == "plain":
        return case(Launch("torchrun", np), f"{name}-plain", "forms", "--form", "plain", *args)
    return case(
        Launch("lightning", np), f"{name}-{kind}", "forms", "--form", kind, "--fabric-package", fabric, *args
    )


def forms(name: str, np: int, *args: str) -> tuple:
    return tuple(form(name, kind, np, *args) for kind in ("plain", "fabric", "trainer"))


def trained(result) -> list[dict]:
    """Every rank's results of one form's case; every rank at the world size, with rank 0's parameters."""
    ranks = result.ranks
    for r, res in enumerate(ranks):
        assert res["world_size"] == result.case.launch.np, (result.case.name, r)
        for name, tensor in ranks[0]["end"].items():
            assert torch.equal(tensor, res["end"][name]), f"{result.case.name}: {name}: rank 0 vs rank {r}"
    return ranks


def assert_same_training(reference: list[dict], other: list[dict], what: str) -> None:
    """Bitwise equal parameters, the same number of steps and (per rank) the same optimizer state."""
    for r, (ref, res) in enumerate(zip(reference, other, strict=True)):
        assert res["steps"] == ref["steps"], (what, r)
        for name, tensor in ref["end"].items():
            difference = (tensor - res["end"][name]).abs().max()
            assert torch.equal(tensor, res["end"][name]), (what, r, name, difference)
        for key, state in ref["opt_state"].items():
            for name, tensor in state.items():
                assert torch.equal(tensor, res["opt_state"][key][name]), (what, r, key, name)


def three_forms(cases, declared: tuple) -> list[dict]:
    plain, fabric, trainer = (trained(cases[c]) for c in declared)
    assert_same_training(plain, fabric, "fabric vs plain")
    assert_same_training(plain, trainer, "trainer vs plain")
    return plain


THREE_FORMS = {
    "sgd-momentum": forms("forms-sgd-momentum", 2, "--optimizer", "sgd", "--momentum", "0.9"),
    "adam": forms("forms-adam", 2, "--optimizer", "adam", "--lr", "0.01"),
}


@pytest.mark.compat
@pytest.mark.parametrize(
    "options", [pytest.param(k, marks=pytest.mark.cases(*c)) for k, c in THREE_FORMS.items()]
)
def test_the_three_forms_train_to_identical_parameters(options, cases):
    plain = three_forms(cases, THREE_FORMS[options])
    assert plain[0]["steps"] == 2 * 64 // 2 // 4
    # each rank kept its own optimizer state (momentum or Adam moments from its own gradients)
    first = next(iter(plain[0]["opt_state"].values()))
    name = "momentum_buffer" if "momentum_buffer" in first else "exp_avg"
    assert not torch.equal(first[name], next(iter(plain[1]["opt_state"].values()))[name])


ACCUMULATION = forms(
    "forms-accumulate-3-clip-norm", 2, "--accumulate", "3", "--clip-norm", "0.05", "--epochs", "1"
)


@pytest.mark.cases(*ACCUMULATION)
def test_accumulation_with_a_partial_window_and_norm_clipping(cases):
    # 8 batches per epoch, a step every 3: steps after batches 3, 6 and 8 (Lightning's partial window)
    plain = three_forms(cases, ACCUMULATION)
    assert plain[0]["steps"] == 3


SKIPPED_STEP = forms(
    "forms-fp16-skipped-step", 2, "--fp16-scaler", "--inf-rank", "1", "--inf-step", "2", "--epochs", "1"
)


@pytest.mark.cases(*SKIPPED_STEP)
def test_a_step_the_gradient_scaler_skips_on_one_rank_is_a_zero_update(cases):
    # rank 1's loss is infinite at step 2: its scaler skips that step, rank 0's does not
    plain = three_forms(cases, SKIPPED_STEP)
    assert all(torch.isfinite(t).all() for t in plain[0]["end"].values())  # the infinite step left no trace


BF16_OPTIONS = ("--bf16", "--clip-value", "0.01", "--epochs", "1")
BF16 = (
    form("forms-bf16-value-clipping", "plain", 2, *BF16_OPTIONS),
    case(Launch("torchrun", 2), "forms-bf16-value-clipping-fabric-instance", "forms", "--form", "fabric",
         "--fabric-package", FABRIC, "--fabric-instance", "--devices", "2", *BF16_OPTIONS),
    form("forms-bf16-value-clipping", "trainer", 2, *BF16_OPTIONS),
)  # fmt: skip


@pytest.mark.cases(*BF16)
def test_bf16_mixed_and_value_clipping_with_fabric_as_an_instance_under_torchrun(cases):
    # Fabric's strategy object, setup_module + setup_optimizers, started by torchrun (not fabric.launch())
    plain, fabric, trainer = (cases[c].ranks for c in BF16)
    assert fabric[0]["strategy"].endswith("fabric.ddp_adasum.DDPAdasumStrategy")
    assert_same_training(plain, fabric, "fabric (instance, torchrun) vs plain")
    assert_same_training(plain, trainer, "trainer vs plain")


LBFGS = forms("forms-lbfgs", 2, "--optimizer", "lbfgs", "--epochs", "1")


@pytest.mark.cases(*LBFGS)
def test_lbfgs_with_a_closure(cases):
    three_forms(cases, LBFGS)


THREE_RANKS = forms("forms-three-ranks", 3, "--epochs", "1")


@pytest.mark.cases(*THREE_RANKS)
def test_a_world_of_three(cases):
    plain = three_forms(cases, THREE_RANKS)
    assert plain[0]["steps"] == 6  # 64 samples padded to 66: 22 per rank, 6 batches


ONE_STEP = form("forms-one-step", "plain", 3, "--epochs", "1", "--max-steps", "1", "--momentum", "0")


@pytest.mark.cases(ONE_STEP)
def test_plain_loop_equals_the_reference_adasum_of_every_ranks_local_step(cases):
    # One step on 3 ranks, computed here in one process: each rank's local SGD step from the common start on
    # its first batch, then the Adasum of the three deltas (adasum_lightning.reference.adasum_reduce).
    ranks = trained(cases[ONE_STEP])
    data = IndexedData(64)
    batches = [[(data.x[res["first_batch"]], data.y[res["first_batch"]])] for res in ranks]
    deltas = [local_delta(ranks[0]["start"], b, momentum=0.0) for b in batches]
    assert_one_step_is_the_adasum_of_local_deltas(ranks, deltas)


LOCAL_SGD_OPTIONS = ("--sync-every", "3", "--momentum", "0.9")
LOCAL_SGD = {
    ("adasum", 0.0): forms("forms-local-sgd-adasum", 2, *LOCAL_SGD_OPTIONS),
    ("mean", 0.7): forms(
        "forms-local-sgd-mean-outer", 2, *LOCAL_SGD_OPTIONS, "--combine", "mean", "--outer-lr", "0.7"
    ),  # fmt: skip
}
LOCAL_SGD_PLAIN = {
    ("adasum", 0.35): form(
        "forms-local-sgd-adasum-outer", "plain", 2, *LOCAL_SGD_OPTIONS, "--outer-lr", "0.35"
    ),
    ("mean", 0.0): form("forms-local-sgd-mean", "plain", 2, *LOCAL_SGD_OPTIONS, "--combine", "mean"),
}


@pytest.mark.parametrize(
    "key",
    [pytest.param(k, marks=pytest.mark.cases(*c), id=f"{k[0]}-outer{k[1]}") for k, c in LOCAL_SGD.items()],
)
def test_local_sgd_trains_the_same_parameters_in_the_three_forms(key, cases):
    plain = three_forms(cases, LOCAL_SGD[key])
    assert plain[0]["steps"] == 16


LOCAL_SGD_ACCUMULATION = forms(
    "forms-local-sgd-accumulate-clip", 2, "--sync-every", "2", "--accumulate", "3", "--clip-norm", "0.05",
    "--combine", "mean", "--epochs", "1",
)  # fmt: skip


@pytest.mark.cases(*LOCAL_SGD_ACCUMULATION)
def test_local_sgd_counts_optimizer_steps_under_accumulation_and_clipping(cases):
    # 8 batches, a step after batches 3, 6 and 8: windows of 2 steps end at step 2 and, cut short, at the end
    plain = three_forms(cases, LOCAL_SGD_ACCUMULATION)
    assert plain[0]["steps"] == 3
    assert torch.equal(plain[0]["trace"][1], plain[1]["trace"][1])  # synced after step 2
    assert not torch.equal(plain[0]["trace"][2], plain[1]["trace"][2])  # step 3: inside the last window


def window_exits(name: str, *args: str):
    """A fit that ends mid-window (step 3 of a 10-step window, an outer optimizer), with more worker
    arguments ``args`` (later ones win)."""
    options = ("--sync-every", "10", "--outer-lr", "0.7", "--momentum", "0.9", "--max-steps", "3")
    return form(f"forms-window-exits-{name}", "trainer", 2, *options, *args)


WINDOW_EXITS = {
    "default": window_exits("default"),
    # H = 2: the fit ends with an exchange in flight and a window of one step
    "overlap_sync-bf16": window_exits(
        "overlap-bf16", "--overlap-sync", "--compression", "bf16", "--sync-every", "2"
    ),
}


@pytest.mark.parametrize(
    "kwargs", [pytest.param(k, marks=pytest.mark.cases(c), id=k) for k, c in WINDOW_EXITS.items()]
)
def test_a_fit_that_ends_mid_window_shows_the_synced_parameters_at_every_exit(kwargs, cases):
    # the last epoch's on_train_epoch_end and on_train_end, in a callback and in the module, on every rank
    ranks = trained(cases[WINDOW_EXITS[kwargs]])  # every rank ends with rank 0's parameters
    exits = ["callback.on_train_epoch_end.0", "module.on_train_epoch_end.0", "callback.on_train_end",
             "module.on_train_end"]  # fmt: skip
    for r, res in enumerate(ranks):
        assert res["steps"] == 3 and sorted(res["exits"]) == sorted(exits), r
        for hook, seen in res["exits"].items():
            for name, tensor in res["end"].items():
                assert torch.equal(seen[name], tensor), (r, hook, name)
    assert not torch.equal(ranks[0]["end"]["0.weight"], ranks[0]["start"]["0.weight"])  # the sync moved them


def assert_every_step_equals(ranks: list[dict], reference: list, end: torch.Tensor, key) -> None:
    """Every rank's 16 traced steps equal its reference trace, its final parameters ``end`` (round-off)."""
    for r, res in enumerate(ranks):
        assert len(res["trace"]) == 16
        for k, (got, want) in enumerate(zip(res["trace"], reference[r], strict=True)):
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (key, r, k, (got - want).abs().max())
        got_end = torch.cat([t.reshape(-1) for t in res["end"].values()])
        assert torch.allclose(got_end, end, rtol=1e-5, atol=1e-6), (key, r, (got_end - end).abs().max())


def batches_of_every_rank(world_size: int, epochs: int = 2) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Each rank's batches in the plain loop: a DistributedSampler shard (seed 100) an epoch, batches of 4."""
    data = IndexedData(64)
    every_rank = []
    for r in range(world_size):
        sampler = torch.utils.data.DistributedSampler(data, world_size, r, shuffle=True, seed=100)
        batches = []
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            indices = list(sampler)
            batches += [
                (data.x[indices[i : i + 4]], data.y[indices[i : i + 4]]) for i in range(0, len(indices), 4)
            ]
        every_rank.append(batches)
    return every_rank


def local_sgd_reference(
    start: dict, rank_batches: list, sync_every: int, combine: str, outer_lr: float, wire=None
):
    """The algorithm written out in one process: each worker's parameters after each of its steps. ``wire``
    (a dtype, ``compression``): every sent piece rounded to it — the Adasum of the rounded pseudo-gradients
    (each level rounded), or their float32 mean rounded once."""
    from adasum_lightning.reference import adasum_reduce
    from tests.workers.samples import tiny_net

    models = [tiny_net() for _ in rank_batches]
    for m in models:
        m.load_state_dict(start)
    inner = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    synced = [p.detach().clone() for p in models[0].parameters()]
    outer_params = [torch.nn.Parameter(s.clone()) for s in synced]
    outer = torch.optim.SGD(outer_params, lr=outer_lr or 1.0, momentum=0.9, nesterov=True)
    steps = len(rank_batches[0])
    trace: list[list[torch.Tensor]] = [[] for _ in models]

    def sync() -> None:
        params = [list(m.parameters()) for m in models]
        for i, s in enumerate(synced):
            deltas = [(worker[i].detach() - s).to(wire or s.dtype) for worker in params]
            combined = adasum_reduce(deltas) if combine == "adasum" else (deltas[0].float() + deltas[1]) / 2
            combined = combined.to(wire or s.dtype).float()
            if outer_lr:
                outer_params[i].data.copy_(s)
                outer_params[i].grad = -combined
            else:
                s.add_(combined)
        if outer_lr:
            outer.step()
            for s, o in zip(synced, outer_params, strict=True):
                s.copy_(o.detach())
        with torch.no_grad():
            for worker in params:
                for p, s in zip(worker, synced, strict=True):
                    p.copy_(s)

    for k in range(steps):
        for m, opt, batches in zip(models, inner, rank_batches, strict=True):
            x, y = batches[k]
            torch.nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
            opt.zero_grad()
        if (k + 1) % sync_every == 0:
            sync()
        for r, m in enumerate(models):
            trace[r].append(torch.cat([p.detach().reshape(-1) for p in m.parameters()]))
    sync()  # the window the end of training cuts short
    return trace, torch.cat([s.reshape(-1) for s in synced])


@pytest.mark.parametrize(
    "key",
    [
        pytest.param(
            k, marks=pytest.mark.cases(c[0] if isinstance(c, tuple) else c), id=f"{k[0]}-outer{k[1]}"
        )
        for k, c in {**LOCAL_SGD, **LOCAL_SGD_PLAIN}.items()
    ],
)
def test_local_sgd_equals_the_algorithm_written_out_and_ranks_agree_only_at_syncs(key, cases):
    # 2 workers, 16 steps, sync every 3 (and at the end): per-worker momentum, the pseudo-gradients combined
    # by Adasum (reference.adasum_reduce) or their mean, applied directly or by an outer Nesterov SGD step.
    declared = {**LOCAL_SGD, **LOCAL_SGD_PLAIN}[key]
    ranks = cases[declared[0] if isinstance(declared, tuple) else declared].ranks
    rank_batches = batches_of_every_rank(2)
    reference, end = local_sgd_reference(ranks[0]["start"], rank_batches, 3, *key)
    assert_every_step_equals(ranks, reference, end, key)
    for k in range(16):
        same = torch.equal(ranks[0]["trace"][k], ranks[1]["trace"][k])
        assert same == ((k + 1) % 3 == 0), (key, k)  # different inside a window, identical at each sync


@pytest.mark.parametrize(
    "key",
    [
        pytest.param(k, marks=pytest.mark.cases(LOCAL_SGD_PLAIN[k]), id=f"{k[0]}-outer{k[1]}")
        for k in LOCAL_SGD_PLAIN
    ],
)
def test_the_benchmarks_simulator_equals_real_ranks(key, cases):
    # benchmarks/local_sgd.py's workers in one process (the study's simulator) against the 2-rank plain
    # loop: 5 rounds of 3 steps on the same batches from the same start
    from benchmarks.local_sgd import simulate_diloco
    from tests.workers.samples import tiny_net

    ranks = cases[LOCAL_SGD_PLAIN[key]].ranks
    combine, outer_lr = key

    def model_fn():
        model = tiny_net()
        model.load_state_dict(ranks[0]["start"])
        return model

    shards = [lambda step, b=batches: b[step] for batches in batches_of_every_rank(2)]
    outer = functools.partial(torch.optim.SGD, lr=outer_lr, momentum=0.9, nesterov=True) if outer_lr else None
    result = simulate_diloco(
        model_fn, shards, sync_every=3, combine=combine, rounds=5, outer_optimizer_fn=outer,
        inner_optimizer_fn=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    )  # fmt: skip
    simulated = torch.cat([p.detach().reshape(-1) for p in result["model"].parameters()])
    for r, res in enumerate(ranks):
        got = res["trace"][14]  # after step 15, the fifth sync
        assert torch.allclose(got, simulated, rtol=1e-5, atol=1e-6), (key, r, (got - simulated).abs().max())


WIRE_OPTIONS = ("--compression", "bf16", "--momentum", "0.9")
WIRE = {
    (1, "adasum", 0.0): forms("forms-wire-bf16-every-step", 2, *WIRE_OPTIONS),
    (3, "adasum", 0.0): tuple(
        form("forms-wire-bf16-local-sgd-adasum", kind, 2, *WIRE_OPTIONS, "--sync-every", "3")
        for kind in ("plain", "trainer")
    ),
    (3, "mean", 0.7): tuple(
        form("forms-wire-bf16-local-sgd-mean-outer", kind, 2, *WIRE_OPTIONS, "--sync-every", "3",
             "--combine", "mean", "--outer-lr", "0.7")
        for kind in ("plain", "fabric")
    ),
}  # fmt: skip


OVERLAP_OPTIONS = ("--momentum", "0.9", "--overlap-sync")
#: (combine, outer lr, sync_every): 16 steps, so H = 3 ends mid-window and H = 2 with an exchange in flight
OVERLAP = {
    ("adasum", 0.35, 3): forms(
        "forms-overlap-adasum-outer", 2, *OVERLAP_OPTIONS, "--sync-every", "3", "--outer-lr", "0.35"
    ),
    ("mean", 0.0, 2): forms(
        "forms-overlap-mean", 2, *OVERLAP_OPTIONS, "--sync-every", "2", "--combine", "mean"
    ),
}
OVERLAP_PLAIN = {
    ("adasum", 0.0, 2): form("forms-overlap-adasum", "plain", 2, *OVERLAP_OPTIONS, "--sync-every", "2"),
    ("adasum", 0.0, 2, "bf16"): form(
        "forms-overlap-adasum-bf16", "plain", 2, *OVERLAP_OPTIONS, "--sync-every", "2", "--compression",
        "bf16",
    ),
    ("mean", 0.7, 3): form(
        "forms-overlap-mean-outer", "plain", 2, *OVERLAP_OPTIONS, "--sync-every", "3", "--combine", "mean",
        "--outer-lr", "0.7",
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    "key", [pytest.param(k, marks=pytest.mark.cases(*c), id="-".join(map(str, k))) for k, c in WIRE.items()]
)
def test_a_bf16_wire_equals_the_algorithm_written_out_with_every_sent_piece_rounded(key, cases):
    # compression="bf16": AdasumOptimizer, Fabric's and the Trainer's ddp_adasum train the same parameters;
    # every rank's trace equals the reference whose pseudo-gradients are rounded to bfloat16 (to float32
    # round-off, far closer than to the float32 wire's), identical on the ranks at every sync
    plain, *others = (trained(cases[c]) for c in WIRE[key])
    for other in others:
        assert_same_training(plain, other, f"{key}: a strategy vs plain")
    rank_batches = batches_of_every_rank(2)
    reference, end = local_sgd_reference(plain[0]["start"], rank_batches, *key, wire=torch.bfloat16)
    float32_wire, _ = local_sgd_reference(plain[0]["start"], rank_batches, *key)
    for r, res in enumerate(plain):
        got, want = torch.stack(res["trace"]), torch.stack(reference[r])
        off = (got - torch.stack(float32_wire[r])).abs().max()
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (key, r, (got - want).abs().max(), off)
        assert off > 1e-4, (key, r, off)
        got_end = torch.cat([t.reshape(-1) for t in res["end"].values()])
        assert torch.allclose(got_end, end, rtol=1e-5, atol=1e-6), (key, r, (got_end - end).abs().max())
    for k in range(key[0] - 1, 16, key[0]):
        assert torch.equal(plain[0]["trace"][k], plain[1]["trace"][k]), (key, k)


def overlap_param(key: tuple, *declared) -> object:
    wire = f"-{key[3]}" if len(key) > 3 else ""
    return pytest.param(key, marks=pytest.mark.cases(*declared), id=f"{key[0]}-outer{key[1]}-H{key[2]}{wire}")


@pytest.mark.parametrize("key", [overlap_param(k, *c) for k, c in OVERLAP.items()])
def test_overlap_sync_trains_the_same_parameters_in_the_three_forms(key, cases):
    plain = three_forms(cases, OVERLAP[key])
    assert plain[0]["steps"] == 16


@pytest.mark.parametrize(
    "key",
    [overlap_param(k, c[0] if isinstance(c, tuple) else c) for k, c in {**OVERLAP, **OVERLAP_PLAIN}.items()],
)
def test_overlap_sync_equals_the_algorithm_written_out_one_window_late(key, cases):
    # tests/reference.py writes out docs/local_sgd.md's equations: window k's combined update applied at the
    # end of window k + 1, each rank going on meanwhile from the synced point plus its own window's progress
    declared = {**OVERLAP, **OVERLAP_PLAIN}[key]
    ranks = cases[declared[0] if isinstance(declared, tuple) else declared].ranks
    combine, outer_lr, sync_every, *wire = key
    start, rank_batches = ranks[0]["start"], batches_of_every_rank(2)
    wire_dtype = torch.bfloat16 if wire else None  # compression="bf16": each δ and C rounded to bfloat16
    reference, end = overlapped_local_sgd_reference(
        start, rank_batches, sync_every, combine, outer_lr, wire_dtype
    )
    assert_every_step_equals(ranks, reference, end, key)
    # One window late: never identical before the end, each rank going on from g + its own δ (applied in the
    # window it ends, as without overlap_sync, the update would make them identical after step H); and the
    # trace after step H above is not the same-window algorithm's:
    for k in range(16):
        assert not torch.equal(ranks[0]["trace"][k], ranks[1]["trace"][k]), (key, k)
    same_window, _ = local_sgd_reference(start, rank_batches, sync_every, combine, outer_lr)
    assert not torch.allclose(same_window[0][sync_every - 1], reference[0][sync_every - 1], atol=1e-3)
    if wire:  # and the rounding shows: the float32 wire's reference is further off than round-off
        float32_wire, _ = overlapped_local_sgd_reference(start, rank_batches, sync_every, combine, outer_lr)
        assert (torch.stack(ranks[0]["trace"]) - torch.stack(float32_wire[0])).abs().max() > 1e-4


#: 4 plain ranks in the 4-rank torchrun launch of tests/test_fsdp_adasum.py (one launch for both files).
LOCAL_SGD_FOUR = case(Launch("torchrun", 4, group="fsdp"), "forms-local-sgd-four-plain", "forms", "--form",
                      "plain", *LOCAL_SGD_OPTIONS, "--outer-lr", "0.35")  # fmt: skip


@pytest.mark.cases(LOCAL_SGD_FOUR)
def test_the_benchmarks_simulator_equals_four_real_ranks(cases):
    # 16 samples a rank, 8 steps; 2 rounds of 3 steps: Adasum of four pseudo-gradients, an outer Nesterov SGD
    from benchmarks.local_sgd import simulate_diloco
    from tests.workers.samples import tiny_net

    ranks = cases[LOCAL_SGD_FOUR].ranks

    def model_fn():
        model = tiny_net()
        model.load_state_dict(ranks[0]["start"])
        return model

    shards = [lambda step, b=batches: b[step] for batches in batches_of_every_rank(4)]
    result = simulate_diloco(
        model_fn, shards, sync_every=3, combine="adasum", rounds=2,
        outer_optimizer_fn=functools.partial(torch.optim.SGD, lr=0.35, momentum=0.9, nesterov=True),
        inner_optimizer_fn=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    )  # fmt: skip
    simulated = torch.cat([p.detach().reshape(-1) for p in result["model"].parameters()])
    assert len(ranks) == 4
    for r, res in enumerate(ranks):
        assert len(res["trace"]) == 8
        got = res["trace"][5]  # after step 6, the second sync
        assert torch.allclose(got, simulated, rtol=1e-5, atol=1e-6), (r, (got - simulated).abs().max())
        assert not torch.equal(res["trace"][6], ranks[(r + 1) % 4]["trace"][6])  # inside the next window


SAVE_LOAD = form("forms-save-load", "fabric", 2, "--epochs", "1", "--save-load")


@pytest.mark.cases(SAVE_LOAD)
def test_fabric_save_and_load_round_trip(cases):
    ranks = trained(cases[SAVE_LOAD])
    ckpt = cases[SAVE_LOAD].out / "fabric.ckpt"
    assert ckpt.is_file()
    saved = torch.load(ckpt, weights_only=False)  # what rank 0 wrote
    assert saved["adasum_world_size"] == 2
    line = f"DDPAdasumStrategy: resumed from {ckpt} at step 8 (world size 2 -> 2); the steps since that"
    assert line in cases[SAVE_LOAD].case_output
    for r, res in enumerate(ranks):
        assert res["loaded_step"] == res["steps"] == 8
        for name, tensor in res["end"].items():
            assert torch.equal(res["loaded"][name], tensor), (r, name)
            assert torch.equal(saved["model"][name], tensor), (r, name)
        # every rank restores rank 0's optimizer state
        for key, state in ranks[0]["opt_state"].items():
            for name, tensor in state.items():
                assert torch.equal(res["loaded_opt_state"][key][name], tensor), (r, key, name)
    # Fabric's collectives on every rank: rank r contributed r + 1
    for res in ranks:
        assert res["all_gather"] == [1.0, 2.0] and res["all_reduce_sum"] == 3.0
        assert res["broadcast"] == "from rank 0"
        assert res["strategy"].endswith("fabric.ddp_adasum.DDPAdasumStrategy")


BOTH_PACKAGES = tuple(
    form(f"forms-package-{package}", "fabric", 2, "--epochs", "1", fabric=package)
    for package in ("lightning_fabric", "lightning.fabric")
)


@pytest.mark.cases(*BOTH_PACKAGES)
def test_fabric_under_both_package_names_trains_identically(cases):
    pytest.importorskip("lightning")
    standalone, unified = (trained(cases[c]) for c in BOTH_PACKAGES)
    assert standalone[0]["strategy"] == "adasum_lightning.fabric.ddp_adasum.DDPAdasumStrategy"
    assert unified[0]["strategy"] == "adasum_lightning.lightning.fabric.ddp_adasum.DDPAdasumStrategy"
    assert_same_training(standalone, unified, "lightning.fabric vs lightning_fabric")


DDP_WRAPPED = form("forms-ddp-wrapped", "fabric", 2, "--ddp-wrapped")


@pytest.mark.cases(DDP_WRAPPED)
def test_fabric_refuses_a_module_wrapped_in_ddp_on_every_rank(cases):
    message = expected_message(check_module_unwrapped, "ddp_adasum", True)
    assert_refused_on_every_rank(cases[DDP_WRAPPED], message)


PLAIN_DDP_WRAPPED = form("forms-ddp-wrapped", "plain", 2, "--ddp-wrapped", "--max-steps", "3")


@pytest.mark.cases(PLAIN_DDP_WRAPPED, THREE_FORMS["sgd-momentum"][0])
def test_adasum_optimizer_warns_once_when_a_ddp_wrapper_made_the_gradients_identical(cases):
    # A DDP script with only its optimizer changed trains as plain DDP would (the wrapper averages the
    # gradients, so every rank's update is the same): rank 0 warns once, at the first step, naming the fix.
    message = identical_gradients_message("AdasumOptimizer")
    wrapped = trained(cases[PLAIN_DDP_WRAPPED])
    assert [res["steps"] for res in wrapped] == [3, 3]
    assert [[w for w in res["warned"] if "identical" in w] for res in wrapped] == [[message], []]
    assert "remove the wrapper: train the module itself (model.module)" in message
    # each rank with its own shard: no such warning on any rank
    plain = cases[THREE_FORMS["sgd-momentum"][0]].ranks
    assert [[w for w in res["warned"] if "identical" in w] for res in plain] == [[], []]


def test_adasum_fabric_run_starts_a_script_whose_strategy_comes_from_the_command_line(tmp_path):
    # Lightning's `fabric run` reads its --strategy choices before the script could import adasum_lightning;
    # adasum-fabric run is the same command with the names registered, in the launcher and in every process.
    script = ["--strategy=ddp_adasum", "--devices=2", "--accelerator=cpu",
              "tests/fixtures/fabric_cli_script.py"]  # fmt: skip
    fabric = str(Path(sys.executable).with_name("fabric"))
    refused = subprocess.run([fabric, "run", *script, str(tmp_path)], cwd=ROOT, env=plain_env(),
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert refused.returncode == 2 and "Invalid value for '--strategy': 'ddp_adasum' is not one of" in (
        refused.stderr
    ), refused.stderr
    adasum_fabric = str(Path(sys.executable).with_name("adasum-fabric"))
    run_job([adasum_fabric, "run", *script, str(tmp_path)], plain_env(), timeout=240)
    ranks = load_ranks(tmp_path, 2)
    for r, res in enumerate(ranks):
        assert res["strategy"] == "adasum_lightning.lightning.fabric.ddp_adasum.DDPAdasumStrategy", r
        assert res["world_size"] == 2, r
        for key in ("start", "end"):  # rank 0's start on every rank, identical after each Adasum step
            for name, tensor in ranks[0][key].items():
                assert torch.equal(tensor, res[key][name]), (key, name, r)
    assert not torch.equal(ranks[0]["start"]["0.weight"], ranks[0]["end"]["0.weight"])


def test_fabric_refuses_a_world_size_its_devices_do_not_describe(tmp_path):
    # Two processes started as an Azure ML PyTorch job starts them (no torchrun); each Fabric says devices=1
    results = run_as_pytorch_job(2, "forms", str(tmp_path), "--form", "fabric", "--devices", "1",
                                 "--fabric-package", FABRIC)  # fmt: skip
    message = expected_message(check_launcher_world_size, 2, 1, 1, api="Fabric")
    for rank, (returncode, out) in enumerate(results):
        assert returncode != 0
        assert f"AdasumConfigurationError on rank {rank}: {message}" in out, out[-3000:]


# ---------------------------------------------------------------------------------- torch only, no Lightning
def torch_only_environment(where: Path) -> Path:
    """A virtual environment holding torch and what torch requires (its installed files, linked from this
    environment), and nothing else: no Lightning, no Horovod. Returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    site = next((where / "lib").glob("python3*/site-packages"))
    wanted, seen = ["torch"], set()
    while wanted:
        name = wanted.pop()
        dist = importlib.metadata.distribution(name)
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        for requirement in map(Requirement, dist.requires or []):
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                wanted.append(requirement.name)
        base = Path(dist.locate_file(""))
        for top in {Path(str(f)).parts[0] for f in dist.files or []}:
            source, link = base / top, site / top
            if top != ".." and source.exists() and not link.exists():
                link.symlink_to(source)
    return where / "bin" / "python"


#: The plain loop in the full environment, in a launch of its own: no Lightning case imports Lightning there.
FULL_ENVIRONMENT = case(Launch("torchrun", 2, group="plain"), "forms-full-environment-plain", "forms",
                        "--form", "plain", "--epochs", "1")  # fmt: skip


@pytest.mark.cases(FULL_ENVIRONMENT)
def test_the_plain_loop_in_an_environment_with_torch_only(cases, tmp_path):
    python = torch_only_environment(tmp_path / "venv")
    env = {**mpi_env(), "PYTHONPATH": str(ROOT)}
    code = (
        "import adasum_lightning.allreduce, adasum_lightning, importlib.util as u\n"
        "names = ('lightning', 'pytorch_lightning', 'lightning_fabric', 'horovod')\n"
        "print([m for m in names if u.find_spec(m)])"
    )
    check = subprocess.run([str(python), "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout == "[]\n", check.stderr[-3000:]
    out = tmp_path / "torch-only"
    cmd = [str(python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "tests.workers.forms", str(out), "--form", "plain", "--epochs", "1"]  # fmt: skip
    run_job(cmd, env, timeout=240)
    alone = load_ranks(out, 2)
    full = trained(cases[FULL_ENVIRONMENT])
    assert (
        full[0]["lightning_imported"] == []
    )  # the plain loop imports no Lightning, even where it is installed
    assert_same_training(full, alone, "torch-only vs full environment")
