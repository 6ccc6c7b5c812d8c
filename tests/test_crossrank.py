"""What Lightning does across ranks works under the Horovod strategies (real horovodrun, 2 ranks).

The tests read ``tests/workers/crossrank.py``'s cases, run in one ``horovodrun -np 2`` launch
(``tests/cases.py``), and check every rank's record; SIGTERM, torchrun and a plain process are launches of
their own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torchmetrics

from adasum_lightning.checkpoint import PERIODIC_SYNC_STATES
from adasum_lightning.horovod.support import (
    check_closure_optimizers,
    check_horovod_dtypes,
    check_launch,
)
from adasum_lightning.launch_environment import DetectedLauncher
from adasum_lightning.replicas import check_sync_batchnorm
from tests.cases import Launch, assert_refused_on_every_rank, case
from tests.helpers import (
    ROOT,
    assert_ranks_identical,
    expected_message,
    horovodrun_cmd,
    load_ranks,
    mpi_env,
    plain_env,
    run_horovod,
    run_job,
)
from tests.workers.lightning import adasum_strategies

pytestmark = pytest.mark.mpi

HOROVOD = ["horovod_adasum", "horovod"]
#: The same, with horovod_adasum also in `make test-compat`'s pass against the oldest pytorch-lightning (each
#: compat run of a row costs a job launch).
HOROVOD_COMPAT = [pytest.param("horovod_adasum", marks=pytest.mark.compat_oldest), "horovod"]


def crossrank(scenario: str, strategy: str, *args: str):
    """``scenario`` of the worker with ``strategy`` in the 2-rank launch."""
    name = "-".join(["crossrank", scenario, strategy, *(a.strip("-") for a in args)])
    return case(Launch("horovodrun", 2), name, "crossrank", "--case", scenario, "--strategy", strategy, *args)


def with_cases(params, cases_of):
    """``pytest.param`` of each tuple in ``params``, marked with the cases ``cases_of(*params)`` declares."""
    return [pytest.param(*p, marks=pytest.mark.cases(*cases_of(*p))) for p in params]


# ---------------------------------------------------------------- 1: synchronised batch norm
def sync_batchnorm(strategy: str, how: str):
    return (crossrank("batchnorm", strategy, how),)


@pytest.mark.parametrize(
    "strategy, how",
    with_cases([(s, h) for s in HOROVOD for h in ("--sync-batchnorm", "--convert-sync-bn")], sync_batchnorm),
)
def test_sync_batchnorm_on_cpu_is_refused_before_any_step(strategy, how, cases):
    result = cases[sync_batchnorm(strategy, how)[0]]
    layers = [] if how == "--sync-batchnorm" else ["bn"]
    message = expected_message(check_sync_batchnorm, "cpu", how == "--sync-batchnorm", layers, strategy)
    assert_refused_on_every_rank(result, message, wrote_nothing=False)
    assert_refused_before_any_step(result.out, result.case.launch.np)


def assert_refused_before_any_step(out: Path, np: int) -> None:
    """Every rank stopped on the configuration error (its record, written from ``on_exception``), stepless."""
    for res in load_ranks(out, np):
        assert res["exception"] == "AdasumConfigurationError" and res["steps"] == []


BATCHNORM = crossrank("batchnorm", "horovod_adasum")


@pytest.mark.cases(BATCHNORM)
def test_without_sync_batchnorm_each_rank_keeps_its_own_statistics(cases):
    ranks = cases[BATCHNORM].ranks
    params = {k: v for k, v in ranks[0]["end"].items() if "running" not in k and "num_batches" not in k}
    for name in params:  # parameters identical …
        assert torch.equal(ranks[0]["end"][name], ranks[1]["end"][name]), name
    # … running statistics are each rank's own (its data are shifted by 3 × rank)
    mean0, mean1 = ranks[0]["end"]["bn.running_mean"], ranks[1]["end"]["bn.running_mean"]
    assert not torch.allclose(mean0, mean1)


# ---------------------------------------------------------------- 2, 3: bool and non-contiguous state
def compat_params(cases_of):
    """HOROVOD_COMPAT, each marked with its cases."""
    return [
        pytest.param(
            s, marks=[pytest.mark.cases(*cases_of(s)), *[pytest.mark.compat_oldest] * (s == "horovod_adasum")]
        )
        for s in HOROVOD
    ]


@pytest.mark.parametrize("strategy", compat_params(lambda s: [crossrank("mask", s)]))
def test_bool_buffer_trains_and_equals_rank_zeros(strategy, cases):
    ranks = cases[crossrank("mask", strategy)].ranks
    rank0_mask = ranks[0]["start"]["mask"]
    assert rank0_mask.dtype == torch.bool and int(rank0_mask.sum()) == 2
    assert int(ranks[1]["start"]["mask"].sum()) == 3  # differed before fit
    for res in ranks:
        assert torch.equal(res["end"]["mask"], rank0_mask)
        assert res["global_step"] == 4
    assert_ranks_identical(ranks)


@pytest.mark.parametrize(
    "strategy", with_cases([(s,) for s in HOROVOD], lambda s: [crossrank("noncontiguous", s)])
)
def test_non_contiguous_parameter_and_buffer_train_identically(strategy, cases):
    ranks = cases[crossrank("noncontiguous", strategy)].ranks
    assert_ranks_identical(ranks)
    for res in ranks:
        assert torch.equal(res["end"]["scale"], ranks[0]["start"]["scale"])  # rank 0's buffer
        assert not torch.equal(res["end"]["extra"], ranks[0]["start"]["extra"])  # the parameter trained


# ---------------------------------------------------------------- 4: bf16-true
def bf16_true(strategy: str):
    return crossrank("mask", strategy, "--precision", "bf16-true")


@pytest.mark.parametrize("strategy", with_cases([(s,) for s in HOROVOD], lambda s: [bf16_true(s)]))
def test_bf16_true_is_refused_before_any_step_naming_bf16_mixed(strategy, cases):
    message = expected_message(check_horovod_dtypes, strategy, "cpu", {torch.bfloat16})
    assert "Use precision='bf16-mixed'" in message
    result = cases[bf16_true(strategy)]
    assert_refused_on_every_rank(result, message, wrote_nothing=False)
    assert_refused_before_any_step(result.out, 2)


# ---------------------------------------------------------------- 5: all_gather with gradients
@pytest.mark.parametrize("strategy", compat_params(lambda s: [crossrank("gather", s, "--steps", "1")]))
def test_all_gather_with_gradients_sums_them_like_ddp(strategy, cases):
    ranks = cases[crossrank("gather", strategy, "--steps", "1")].ranks
    for r, res in enumerate(ranks):
        assert torch.equal(res["gathered"], torch.tensor([[1.0], [2.0]]))
        # loss = Σ gathered on each rank; x_r = w·(r+1): the gradient of x_r sums both ranks' (1 + 1)
        assert torch.equal(res["w_grads"][0], torch.tensor([2.0 * (r + 1)]))


# ---------------------------------------------------------------- 6: torchmetrics with list states
@pytest.mark.parametrize("strategy", compat_params(lambda s: [crossrank("metrics", s)]))
def test_torchmetrics_list_states_are_computed_over_every_rank(strategy, cases):
    ranks = cases[crossrank("metrics", strategy)].ranks
    values, preds, targets = [], [], []
    for r in range(2):  # what the worker's ranks fed in (3 and 6 samples)
        count = 3 * (r + 1)
        values.append(torch.arange(count, dtype=torch.float32) + 100 * r)
        gen = torch.Generator().manual_seed(r)
        preds.append(torch.rand(count, generator=gen))
        target = torch.randint(0, 2, (count,), generator=gen)
        target[0] = -1
        targets.append(target)
    auroc = torchmetrics.classification.BinaryAUROC(ignore_index=-1)(torch.cat(preds), torch.cat(targets))
    for res in ranks:
        assert torch.equal(res["cat"], torch.cat(values))
        assert torch.equal(res["auroc"], auroc)


# ---------------------------------------------------------------- 10: closure optimizers
LBFGS_REFUSED, LBFGS = crossrank("lbfgs", "horovod_adasum"), crossrank("lbfgs", "horovod")


@pytest.mark.cases(LBFGS_REFUSED)
def test_lbfgs_is_refused_by_horovod_adasum_before_any_step(cases):
    message = expected_message(check_closure_optimizers, "horovod_adasum", ["LBFGS"])
    assert_refused_on_every_rank(cases[LBFGS_REFUSED], message, wrote_nothing=False)
    assert_refused_before_any_step(cases[LBFGS_REFUSED].out, 2)


@pytest.mark.compat_oldest
@pytest.mark.cases(LBFGS)
def test_lbfgs_trains_identically_under_horovod_averaging(cases):
    ranks = cases[LBFGS].ranks
    assert_ranks_identical(ranks)
    assert all(res["global_step"] == 4 for res in ranks)
    assert not torch.equal(ranks[0]["end"]["head.weight"], ranks[0]["start"]["head.weight"])


# ---------------------------------------------------------------- 7: SIGTERM to rank 0
@pytest.mark.walltime
@pytest.mark.parametrize("strategy", [pytest.param("horovod_adasum", marks=pytest.mark.compat), "horovod"])
def test_sigterm_to_rank_zero_stops_every_rank_at_the_same_step(strategy, tmp_path):
    if not adasum_strategies._compat.has_sigterm_agreement():
        pytest.skip(
            "this Lightning has no SIGTERM agreement between ranks (added after 2.4; DDP lacks it too)"
        )
    start = time.monotonic()
    args = ["--case", "sigterm", "--strategy", strategy, "--sigterm-step", "3"]
    proc = run_horovod(2, "crossrank", str(tmp_path), *args, check=False, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0 and elapsed < 60, (proc.returncode, elapsed, proc.stderr[-3000:])
    ranks = load_ranks(tmp_path, 2)
    steps = {res["global_step"] for res in ranks}
    assert len(steps) == 1 and steps.pop() >= 3, [res["global_step"] for res in ranks]
    assert all(res["exception"] == "SIGTERMException" for res in ranks)
    (ckpt,) = (tmp_path / "ckpt").glob("*.ckpt")
    # every rank's own optimizer state went with it (a resume continues each rank from its own state,
    # tests/test_resume.py): rank 1's beside it
    assert torch.load(ckpt, weights_only=False)["adasum_rank_optimizer_states"]["world_size"] == 2
    assert torch.load(f"{ckpt}.rank1-optimizer.pt", weights_only=False)["rank"] == 1


@pytest.mark.parametrize("overlap", [False, True], ids=["sync-lightning", "overlap_sync-torchrun"])
def test_sigterm_under_local_sgd_stops_every_rank_where_a_window_ends(overlap, tmp_path):
    # SIGTERM to rank 0 in step 6 of windows of 4 steps. The ranks meet only where windows end (no broadcast
    # at every batch): every rank stops after step 8 with the synced parameters. With overlap_sync they do
    # not meet there either: rank 0's flag, sent after step 8, is read after step 12, where every rank stops.
    # Lightning's launcher forwards rank 0's SIGTERM to rank 1 when rank 0 handles it (it may arrive after
    # the flag); torchrun does not forward it: rank 1 stops on rank 0's flag alone.
    if not adasum_strategies._compat.has_sigterm_agreement():
        pytest.skip("this Lightning has no SIGTERM agreement between ranks (added after 2.4)")
    worker = ["-m", "tests.workers.crossrank", str(tmp_path), "--case", "sigterm"]
    args = ["--strategy", "ddp_adasum", "--devices", "2", "--sync-every", "4", "--sigterm-step", "5"]
    if overlap:
        torchrun = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "2"]
        cmd, env = [*torchrun, *worker, *args, "--overlap-sync"], mpi_env()
    else:
        cmd, env = [sys.executable, *worker, *args], plain_env()
    proc = run_job(cmd, env, timeout=120, check=False, merged=True)
    assert proc.returncode != 0, proc.stdout[-3000:]
    ranks = load_ranks(tmp_path, 2)
    stop = 12 if overlap else 8
    assert [res["global_step"] for res in ranks] == [stop, stop], proc.stdout[-3000:]
    assert [res["exception"] for res in ranks] == ["SIGTERMException"] * 2
    for name, tensor in ranks[0]["at_exception"].items():
        # with overlap_sync each rank holds θ_sync plus its own last window until the checkpoint ends it
        assert torch.equal(tensor, ranks[1]["at_exception"][name]) != overlap, name
        assert not torch.equal(tensor, ranks[0]["start"][name]), name
    (ckpt,) = (tmp_path / "ckpt").glob("*.ckpt")
    saved = torch.load(ckpt, weights_only=False)
    assert saved["global_step"] == stop
    assert [window["steps"] for window in saved[PERIODIC_SYNC_STATES]] == [0]  # saved where the window ended


# ---------------------------------------------------------------- 8: SIGTERM to the launcher
def _wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = (
        Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][:1] if Path(f"/proc/{pid}").exists() else "X"
    )
    return state not in ("Z", "X")


@pytest.mark.walltime
@pytest.mark.parametrize("launcher", ["adasum-horovodrun", "mpirun"])
def test_sigterm_to_the_launcher_ends_every_rank(launcher, tmp_path):
    worker = [sys.executable, "-m", "tests.workers.crossrank", str(tmp_path), "--case", "long"]
    if launcher == "mpirun":
        cmd = [
            "mpirun",
            "-np",
            "2",
            "--oversubscribe",
            "--mca",
            "mpi_yield_when_idle",
            "1",
            *worker[:1],
            *worker[1:],
        ]
    else:
        cmd = [str(Path(sys.executable).with_name("adasum-horovodrun")), *horovodrun_cmd(2)[1:], *worker]
    job = subprocess.Popen(
        cmd, env=mpi_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        started = _wait_for(lambda: all((tmp_path / f"step{r}").exists() for r in range(2)), 120)
        assert started, "the ranks did not start training"
        pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
        sent = time.monotonic()
        job.send_signal(signal.SIGTERM)
        assert _wait_for(lambda: not any(_alive(pid) for pid in pids), 60), (
            "ranks still running 60 s after SIGTERM"
        )
        rc = job.wait(timeout=30)
        elapsed = time.monotonic() - sent
    finally:
        if job.poll() is None:
            job.kill()
        for r in range(2):
            pid_file = tmp_path / f"pid{r}"
            if pid_file.exists() and _alive(pid := int(pid_file.read_text())):
                os.kill(pid, signal.SIGKILL)
    assert rc != 0 and elapsed < 60, (rc, elapsed)


# ---------------------------------------------------------------- 9: the wrong launcher
def test_torchrun_is_refused_on_every_process_naming_horovodrun(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [
        str(torchrun),
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "tests.workers.crossrank",
        str(tmp_path),
        "--case",
        "mask",
    ]
    proc = subprocess.run(cmd, env=mpi_env(), cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0
    message = expected_message(
        check_launch,
        1,
        DetectedLauncher("torchrun", 2, "WORLD_SIZE", False),
        1,
        strategy_name="horovod_adasum",
    )
    assert "torchrun started 2 processes" in message and "horovodrun -np 2" in message
    out = proc.stdout + proc.stderr
    assert out.count(f"AdasumConfigurationError on rank 0: {message}") == 2, out[
        -4000:
    ]  # each process: rank 0
    assert_refused_before_any_step(tmp_path, np=1)  # both processes are "rank 0" of a world of 1


def plain_process(strategy: str):
    return case(Launch("python", 1), f"crossrank-devices-2-{strategy}", "crossrank", "--case", "mask",
                "--strategy", strategy, "--devices", "2")  # fmt: skip


@pytest.mark.parametrize("strategy", with_cases([(s,) for s in HOROVOD], lambda s: [plain_process(s)]))
def test_devices_two_in_a_plain_process_is_refused(strategy, cases):
    result = cases[plain_process(strategy)]
    message = expected_message(check_launch, 1, None, 2, strategy_name=strategy)
    assert "no launcher (a plain `python` start)" in message and "horovodrun -np 2" in message
    assert_refused_on_every_rank(result, message, wrote_nothing=False)
    assert_refused_before_any_step(result.out, result.case.launch.np)
