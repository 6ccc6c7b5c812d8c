"""``ddp_adasum``: Adasum of parameter deltas on torch.distributed, launched by Lightning itself or torchrun.

Every test reads real processes (``Trainer(devices=N)`` started as a plain ``python``, or ``torchrun``),
run as cases of a few launches (``tests/cases.py``), and checks every rank against a reference computed here
in one process. SLURM's and Azure ML's environments and a killed rank are launches of their own.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from lightning_fabric.plugins.environments.lightning import find_free_network_port

from adasum_lightning.launch_environment import check_launcher_world_size
from adasum_lightning.reference import adasum
from tests.cases import Launch, case
from tests.helpers import (
    ROOT,
    assert_ranks_identical,
    expected_message,
    load_ranks,
    plain_env,
    run_as_pytorch_job,
    run_lightning,
)
from tests.reference import assert_one_step_is_the_adasum_of_local_deltas, local_delta, strip
from tests.workers.tiny import tiny_net

pytestmark = pytest.mark.mpi


def fit(name: str, np: int, *args: str, launcher: str = "lightning", strategy: str = "ddp_adasum"):
    return case(Launch(launcher, np), name, "fit", "--strategy", strategy, *args)


# ---------------------------------------------------------------- launched by Lightning, torchrun and srun
LAUNCHED = {
    np: fit(f"ddp_adasum-{np}-step-scheduler", np, "--scheduler", "step", "--lr", "0.05") for np in (2, 4)
}


@pytest.mark.parametrize(
    "np", [pytest.param(2, marks=[pytest.mark.compat, pytest.mark.cases(LAUNCHED[2])]),
           pytest.param(4, marks=pytest.mark.cases(LAUNCHED[4]))]
)  # fmt: skip
def test_lightning_launches_the_processes_and_ranks_stay_identical(np, cases):
    ranks = cases[LAUNCHED[np]].ranks
    assert_ranks_identical(ranks, "start")  # rank 0's initial weights (each rank seeded differently)
    assert_ranks_identical(ranks, "end")
    for res in ranks:
        assert res["world_size"] == np and res["global_step"] == 2 * 64 // np // 4
        assert res["start_lr"] == pytest.approx(0.05) and res["base_lrs"] == [pytest.approx(0.05)]  # unscaled
    for e in range(2):  # disjoint, complete shards
        per_epoch = 64 // np
        seen = [set(res["indices"][e * per_epoch : (e + 1) * per_epoch]) for res in ranks]
        assert set().union(*seen) == set(range(64)) and sum(map(len, seen)) == 64


TORCHRUN = fit("ddp_adasum-torchrun", 2, "--epochs", "1", "--devices", "2", launcher="torchrun")


@pytest.mark.compat_oldest
@pytest.mark.cases(TORCHRUN)
def test_torchrun_launches_the_processes(cases):
    ranks = cases[TORCHRUN].ranks
    assert all(res["world_size"] == 2 and res["global_step"] == 8 for res in ranks)
    assert_ranks_identical(ranks)


TWO_OPTIMIZERS = fit("ddp_adasum-two-optimizers", 2, "--model", "two_optimizers", "--epochs", "2")


@pytest.mark.cases(TWO_OPTIMIZERS)
def test_two_optimizers_with_manual_optimization(cases):
    # a GAN's pattern (Lightning's GAN example): manual optimization, one optimizer per sub-network, each
    # optimizer.step() the Adasum of that optimizer's deltas; each rank trains on its own shard
    ranks = cases[TWO_OPTIMIZERS].ranks
    assert all(res["global_step"] == 32 for res in ranks)  # 8 batches × 2 epochs × 2 optimizer steps
    assert_ranks_identical(ranks, "start")
    assert_ranks_identical(ranks)
    for name in ("net.0.weight", "head.weight"):
        assert not torch.equal(ranks[0]["end"][name], ranks[0]["start"][name]), name


TRANSFORMER = fit("ddp_adasum-transformer-norm-clipping", 2, "--model", "transformer", "--epochs", "1",
                  "--clip-value", "0.05", "--clip-algorithm", "norm")  # fmt: skip


@pytest.mark.cases(TRANSFORMER)
def test_a_transformer_with_norm_clipping_trains_identically_on_every_rank(cases):
    # Lightning's transformer example's parameter kinds (attention, LayerNorm, feed-forward) with
    # gradient_clip_val: each rank clips its own gradients before its local step (no refusal, no fallback)
    ranks = cases[TRANSFORMER].ranks
    assert all(res["global_step"] == 8 for res in ranks)
    assert_ranks_identical(ranks, "start")
    assert_ranks_identical(ranks)
    changed = {name for name, t in ranks[0]["end"].items() if not torch.equal(t, ranks[0]["start"][name])}
    layer = "net.1.layers.0"
    assert {f"{layer}.self_attn.in_proj_weight", f"{layer}.norm1.weight", "net.3.weight"} <= changed


def test_srun_tasks_train_through_lightnings_slurm_environment(tmp_path):
    # Two processes started the way `srun --ntasks-per-node=2` starts them: SLURM's variables only (no RANK,
    # WORLD_SIZE or MASTER_ADDR). Lightning's SLURMEnvironment gives the ranks and the address (the first
    # host of SLURM_NODELIST); MASTER_PORT is set as a batch script would, so that runs cannot collide.
    port = find_free_network_port()
    slurm = {"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1", "SLURM_NODEID": "0",
             "SLURM_NODELIST": "localhost", "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "train",
             "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2"}  # fmt: skip
    procs = []
    for rank in range(2):
        task = {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "MASTER_PORT": str(port)}
        env = {**plain_env(), **slurm, **task}
        cmd = [sys.executable, "-m", "tests.workers.fit", str(tmp_path), "--strategy", "ddp_adasum",
               "--devices", "2", "--epochs", "1"]  # fmt: skip
        out = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, **out))
    outputs = [proc.communicate(timeout=180)[0] for proc in procs]
    for proc, out in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out[-3000:]
    ranks = load_ranks(tmp_path, 2)
    for rank, res in enumerate(ranks):
        assert res["cluster_environment"] == "SLURMEnvironment"
        assert (res["world_size"], res["local_rank"], res["node_rank"]) == (2, rank, 0)
        assert res["global_step"] == 8
    assert_ranks_identical(ranks)


ONE_STEP = fit("ddp_adasum-one-step", 2, "--max-steps", "1")


@pytest.mark.compat_oldest
@pytest.mark.cases(ONE_STEP)
def test_one_step_is_the_adasum_of_the_local_deltas(cases):
    ranks = cases[ONE_STEP].ranks
    start = strip(ranks[0]["start"])
    deltas = [local_delta(start, res["batches"][:1]) for res in ranks]
    assert not torch.equal(ranks[0]["batches"][0][0], ranks[1]["batches"][0][0])
    assert_one_step_is_the_adasum_of_local_deltas(ranks, deltas)
    # and it is neither their sum nor their mean
    end = strip(ranks[0]["end"])["0.weight"]
    for combined in (
        deltas[0]["0.weight"] + deltas[1]["0.weight"],
        (deltas[0]["0.weight"] + deltas[1]["0.weight"]) / 2,
    ):
        assert not torch.allclose(end, start["0.weight"] + combined, rtol=1e-5, atol=1e-7)


THREE = fit("ddp_adasum-three-ranks", 3, "--max-steps", "1", "--samples", "96")


@pytest.mark.cases(THREE)
def test_three_processes_use_the_documented_order(cases):
    ranks = cases[THREE].ranks
    start = strip(ranks[0]["start"])
    deltas = [local_delta(start, res["batches"][:1]) for res in ranks]
    assert_one_step_is_the_adasum_of_local_deltas(ranks, deltas)
    # rank 2 is folded into rank 0 first: adasum(adasum(d0, d2), d1), which is not adasum(adasum(d0, d1), d2)
    name = "0.weight"
    folded = adasum(adasum(deltas[0][name], deltas[2][name]), deltas[1][name])
    assert torch.allclose(strip(ranks[0]["end"])[name], start[name] + folded, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- the same result as Horovod's Adasum
def same_training(optimizer: str) -> tuple:
    args = ("--epochs", "3", "--optimizer", optimizer, "--lr", "0.05")  # 3 epochs × 8 steps = 24 steps
    return (
        fit(f"as-horovod-{optimizer}-ddp_adasum", 2, *args),
        fit(
            f"as-horovod-{optimizer}-horovod_adasum",
            2,
            *args,
            launcher="horovodrun",
            strategy="horovod_adasum",
        ),
    )


SAME_TRAINING = {o: same_training(o) for o in ("sgd", "adam")}


@pytest.mark.parametrize(
    "optimizer", [pytest.param(o, marks=pytest.mark.cases(*c)) for o, c in SAME_TRAINING.items()]
)
def test_same_training_as_horovod_adasum(optimizer, cases):
    ddp, hvd = (cases[c].ranks for c in SAME_TRAINING[optimizer])
    assert_ranks_identical(ddp)
    assert (
        ddp[0]["indices"] == hvd[0]["indices"] and ddp[1]["indices"] == hvd[1]["indices"]
    )  # same data order
    assert all(res["global_step"] == 24 for res in ddp + hvd)
    for name, tensor in hvd[0]["end"].items():
        change = (tensor - hvd[0]["start"][name]).abs().max().item()
        diff = (ddp[0]["end"][name] - tensor).abs().max().item()
        assert diff <= 1e-5 * max(change, 1e-3), (name, diff, change)  # float32 rounding only


# ---------------------------------------------------------------- what Horovod's Adasum optimizer forbids
NORM_CLIPPING = fit("ddp_adasum-norm-clipping", 2, "--max-steps", "1", "--momentum", "0",
                    "--loss-scale", "1e4", "--clip-value", "0.5", "--clip-algorithm", "norm")  # fmt: skip


@pytest.mark.cases(NORM_CLIPPING)
def test_norm_clipping_clips_the_delta_of_a_huge_gradient(cases):
    clip = 0.5
    ranks = cases[NORM_CLIPPING].ranks
    start = strip(ranks[0]["start"])
    deltas = [local_delta(start, res["batches"][:1], momentum=0.0, clip_norm=clip) for res in ranks]
    for d in deltas:  # the reference's local deltas were clipped: ‖lr · g‖ ≤ lr · clip
        assert torch.cat([v.flatten() for v in d.values()]).norm() <= 0.1 * clip * (1 + 1e-5)
    assert_one_step_is_the_adasum_of_local_deltas(ranks, deltas)


BF16 = fit("ddp_adasum-bf16-mixed", 2, "--max-steps", "1", "--precision", "bf16-mixed")


@pytest.mark.cases(BF16)
def test_bf16_mixed_on_cpu(cases):
    ranks = cases[BF16].ranks
    start = strip(ranks[0]["start"])
    deltas = [local_delta(start, res["batches"][:1], bf16=True) for res in ranks]
    assert_one_step_is_the_adasum_of_local_deltas(ranks, deltas, rtol=1e-4, atol=1e-6)


FP16 = fit(
    "ddp_adasum-fp16-scaler", 2, "--max-steps", "1", "--fp16-scaler", "--inf-rank", "0", "--inf-step", "0"
)


@pytest.mark.compat_oldest
@pytest.mark.cases(FP16)
def test_fp16_gradient_scaler_skips_an_overflowing_rank(cases):
    # Rank 0's loss is infinite at step 0: its scaler skips the step, its delta is 0, and the Adasum of
    # (0, d1) is d1 exactly (a zero vector's coefficient is 1).
    ranks = cases[FP16].ranks
    start = strip(ranks[0]["start"])
    delta1 = local_delta(start, ranks[1]["batches"][:1])  # in float32: fp16 autocast changes only rounding
    for res in ranks:
        for name, end in strip(res["end"]).items():
            assert torch.allclose(end, start[name] + delta1[name], rtol=2e-3, atol=2e-5), name
    assert_ranks_identical(ranks)


LBFGS = fit("ddp_adasum-lbfgs", 2, "--max-steps", "1", "--optimizer", "lbfgs", "--lr", "0.5")


@pytest.mark.cases(LBFGS)
def test_lbfgs(cases):
    ranks = cases[LBFGS].ranks
    start = strip(ranks[0]["start"])
    deltas = [local_delta(start, res["batches"][:1], optimizer="lbfgs", lr=0.5) for res in ranks]
    assert_one_step_is_the_adasum_of_local_deltas(ranks, deltas, rtol=1e-4, atol=1e-6)


PARTIAL_WINDOW = fit("ddp_adasum-partial-window", 2, "--epochs", "1", "--samples", "40", "--accumulate", "3",
                     "--momentum", "0")  # fmt: skip


@pytest.mark.compat_oldest
@pytest.mark.cases(PARTIAL_WINDOW)
def test_accumulation_with_a_partial_window(cases):
    # 40 samples / 2 ranks / batch 4 = 5 batches, k = 3: windows 3 + 2 (the partial one is stepped).
    ranks = cases[PARTIAL_WINDOW].ranks
    assert all(res["global_step"] == 2 for res in ranks)
    assert_ranks_identical(ranks)
    start = strip(ranks[0]["start"])
    first = [local_delta(start, res["batches"][:3], momentum=0.0) for res in ranks]  # window 1: batches 0–2
    after_first = {k: start[k] + adasum(first[0][k], first[1][k]) for k in start}
    # Window 2 (batches 3–4) is partial; Lightning still divides each micro-batch's loss by k = 3.
    second = []
    for res in ranks:
        net = tiny_net()
        net.load_state_dict(after_first)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for x, y in res["batches"][3:5]:
            (F.cross_entropy(net(x), y) / 3).backward()
        opt.step()
        second.append({k: v.detach() - after_first[k] for k, v in net.state_dict().items()})
    for r, res in enumerate(ranks):
        for name, end in strip(res["end"]).items():
            expected = after_first[name] + adasum(second[0][name], second[1][name])
            assert torch.allclose(end, expected, rtol=1e-5, atol=1e-7), (r, name)


# ---------------------------------------------------------------- faults
@pytest.mark.walltime
def test_a_killed_rank_ends_the_job_quickly(tmp_path):
    start = time.monotonic()
    proc = run_lightning(2, "fit", str(tmp_path), "--strategy", "ddp_adasum", "--epochs", "50",
                         "--kill-rank", "1", "--kill-at-step", "5", check=False, timeout=120)  # fmt: skip
    elapsed = time.monotonic() - start
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert elapsed < 60, elapsed
    assert not list(tmp_path.glob("rank*.pt"))


def test_a_world_size_that_the_trainer_does_not_describe_is_refused(tmp_path):
    # Two processes started as an Azure ML PyTorch job starts them (MASTER_ADDR/PORT, WORLD_SIZE, NODE_RANK,
    # RANK, LOCAL_RANK; no torchrun), but each Trainer says devices=1: Lightning would make both rank 0.
    results = run_as_pytorch_job(2, "fit", str(tmp_path), "--strategy", "ddp_adasum")
    message = expected_message(check_launcher_world_size, 2, 1, 1)
    for rank, (returncode, out) in enumerate(results):
        assert returncode != 0
        assert f"AdasumConfigurationError on rank {rank}: {message}" in out, out[-3000:]


# ---------------------------------------------------------------- overlap_backward=True
OVERLAP = {
    (np, o, k): case(Launch("torchrun", np), f"overlap-{np}-{o}-{k}", "overlap", o, str(k), timeout=240)
    for np, o, k in [(2, "sgd", 1), (2, "adam", 2), (3, "adam", 1), (4, "sgd", 2)]
}


@pytest.mark.parametrize(
    ("np", "optimizer", "accumulate"),
    [pytest.param(*k, marks=pytest.mark.cases(c)) for k, c in OVERLAP.items()],
)
def test_overlap_backward_gives_the_whole_steps_parameters_bitwise(np, optimizer, accumulate, cases):
    result = cases[OVERLAP[np, optimizer, accumulate]]
    ranks = result.ranks
    batches = math.ceil(math.ceil(64 / np) / 4)  # per rank and epoch (the sampler pads to equal shards)
    for r, res in enumerate(ranks):
        assert res["buckets"] == [3], r  # the overlap fit stepped bucket by bucket, in three buckets
        assert res["fallback_buckets"] == [None], r
        assert res["steps"][0] == res["steps"][1] == 2 * math.ceil(batches / accumulate), r
        for name, tensor in res["whole"].items():
            assert torch.equal(res["overlap"][name], tensor), (r, name)
            assert torch.equal(res["fallback"][name], tensor), (r, name)
    assert_ranks_identical(ranks, "overlap")
    start = ranks[0]["start"]
    assert torch.equal(ranks[0]["overlap"]["frozen.weight"], start["frozen.weight"])
    assert not torch.equal(ranks[0]["overlap"]["net.0.weight"], start["net.0.weight"])  # trained
    optimizer_class = "Adam" if optimizer == "adam" else "SGD"
    reason = (
        f"DDPAdasumStrategy: overlap_backward: {optimizer_class} takes the whole step after backward, "
        "because gradient clipping (gradient_clip_val=1000000000.0) needs every gradient before the first "
        "bucket steps"
    )
    assert result.case_output.count(reason) == 1  # rank 0, once in that fit
    for r, res in enumerate(ranks):  # on_after_backward changes the gradients: the whole step, same result
        assert res["halved_buckets"] == [None], r
        assert not torch.equal(res["halved"]["net.0.weight"], res["whole"]["net.0.weight"]), r
        for name, tensor in res["halved"].items():
            assert torch.equal(res["halved_overlap"][name], tensor), (r, name)
    halving = (
        f"{optimizer_class} takes the whole step after backward, because HalveGradients.on_after_backward"
    )
    assert halving in result.case_output
