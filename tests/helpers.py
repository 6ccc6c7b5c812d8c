"""Helpers of the tests: launch real multi-process jobs under ``horovodrun`` and collect every rank's results.

Workers live in ``tests/workers/`` and run as modules (``python -m tests.workers.NAME``) from the repository
root, so that they import ``tests.workers.tiny`` and the project like the tests do.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adasum_lightning.errors import AdasumConfigurationError

ROOT = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers"
SHARED_MNIST = ROOT.parent / "shared" / "data"


def horovodrun_cmd(np: int, *, gloo: bool = False) -> list[str]:
    """``horovodrun -np N -H localhost:N`` for this venv, with Open MPI yielding when idle."""
    horovodrun = Path(sys.executable).with_name("horovodrun")
    cmd = [str(horovodrun), "-np", str(np), "-H", f"localhost:{np}"]
    if gloo:
        cmd.append("--gloo")
    else:
        cmd += ["--mpi", "--mpi-args=--mca mpi_yield_when_idle 1"]
    return cmd


#: torch.distributed's rendezvous variables. Lightning writes MASTER_ADDR/MASTER_PORT into the environment of
#: the process that fits (the tests' own in-process fits too); a job started with them would meet at that
#: old port, possibly another job's.
TORCH_DISTRIBUTED_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE")


def mpi_env() -> dict[str, str]:
    """The environment for a job started by the tests: this one, without torch.distributed's rendezvous
    variables, with Open MPI allowed to run as root, one thread per process and the checkout importable."""
    env = {k: v for k, v in os.environ.items() if k not in TORCH_DISTRIBUTED_VARIABLES}
    env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    )
    return env


def run_horovod(
    np: int, script: str | Path, *args: str, timeout: float = 240, gloo: bool = False, check: bool = True
) -> subprocess.CompletedProcess:
    """Run ``script`` (a path, or a worker module name under tests/workers) on ``np`` ranks.

    With ``check`` the call fails the test (showing the output's end) when the job exits non-zero.
    """
    target = [str(script)] if os.sep in str(script) else ["-m", f"tests.workers.{script}"]
    cmd = horovodrun_cmd(np, gloo=gloo) + [sys.executable, *target, *args]
    return run_job(cmd, mpi_env(), timeout, check)


def load_ranks(out: Path, np: int) -> list[dict]:
    """The ``rank{r}.pt`` files every rank wrote, in rank order (fails if one is missing)."""
    missing = [r for r in range(np) if not (out / f"rank{r}.pt").exists()]
    assert not missing, f"ranks {missing} wrote no result in {out}"
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(np)]


def quick_fit(model, strategy="horovod_adasum", limit_train_batches: int = 2, **trainer_kwargs):
    """One short CPU epoch in this process (world size 1), without logger, progress bar or checkpoints."""
    from tests.workers.lightning import pl

    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        max_epochs=1,
        limit_train_batches=limit_train_batches,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        **trainer_kwargs,
    )
    trainer.fit(model)
    return trainer


def expected_message(rule, *args, **kwargs) -> str:
    """The text a validation rule raises for these inputs (the rules are pure functions)."""
    with pytest.raises(AdasumConfigurationError) as info:
        rule(*args, **kwargs)
    return str(info.value)


def assert_every_rank_says(output: str, np: int, message: str) -> None:
    """Every rank reported exactly ``message`` (the same text) in a job's ``output``, and no training step
    ran."""
    # horovodrun tags each line with its rank ([1,r]<stderr>: under MPI, [r]<stderr>: under Gloo);
    # lines of different ranks can be spliced together, so the tags are dropped and the full report is
    # searched for, once per rank.
    out = TAG.sub("", output)
    for r in range(np):
        assert f"AdasumConfigurationError on rank {r}: {message}" in out, f"rank {r}:\n{out[-4000:]}"
    assert "Epoch 0" not in out and "train_loss" not in out


TAG = re.compile(r"\[(?:1,)?\d+\]<std(?:out|err)>:")


def assert_ranks_identical(ranks: list[dict], key: str = "end") -> None:
    """Every rank's ``key`` state dict equals rank 0's, tensor for tensor (bitwise)."""
    for r, res in enumerate(ranks[1:], start=1):
        for name, tensor in ranks[0][key].items():
            assert torch.equal(tensor, res[key][name]), f"{key}[{name}] differs between rank 0 and rank {r}"


def run_lightning(
    np: int, worker: str, *args: str, timeout: float = 240, check: bool = True
) -> subprocess.CompletedProcess:
    """Run a worker with ``--devices np`` as a plain process: Lightning starts the other processes."""
    cmd = [sys.executable, "-m", f"tests.workers.{worker}", *args, "--devices", str(np)]
    return run_job(cmd, plain_env(), timeout, check)


def plain_env() -> dict[str, str]:
    """:func:`mpi_env` without any launcher's rank variables: a plain ``python`` start."""
    launchers = (
        "OMPI_COMM_WORLD",
        "PMI_",
        "HOROVOD_",
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "TORCHELASTIC",
        "SLURM_",
    )
    return {k: v for k, v in mpi_env().items() if not k.startswith(launchers)}


def run_as_pytorch_job(np: int, worker: str, *args: str, timeout: float = 120) -> list[tuple[int, str]]:
    """Start ``np`` processes of a worker the way an Azure ML PyTorch job does (``MASTER_ADDR``/``PORT``,
    ``WORLD_SIZE``, ``NODE_RANK``, ``RANK``, ``LOCAL_RANK``; no torchrun): (exit status, output) of each."""
    from lightning_fabric.plugins.environments.lightning import find_free_network_port

    port, procs = find_free_network_port(), []
    for rank in range(np):
        env = dict(plain_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(np),
                   NODE_RANK="0", RANK=str(rank), LOCAL_RANK=str(rank))  # fmt: skip
        cmd = [sys.executable, "-m", f"tests.workers.{worker}", *args]
        out = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, **out))
    outputs = [proc.communicate(timeout=timeout)[0] for proc in procs]
    return [(proc.returncode, out) for proc, out in zip(procs, outputs, strict=True)]


def run_torchrun(
    np: int, worker: str, *args: str, timeout: float = 240, check: bool = True
) -> subprocess.CompletedProcess:
    """Run a worker under ``torchrun --standalone --nproc-per-node np`` (one device per process)."""
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", str(np), "-m",
           f"tests.workers.{worker}", *args]  # fmt: skip
    return run_job(cmd, mpi_env(), timeout, check)


def run_job(
    cmd: list[str],
    env: dict[str, str],
    timeout: float,
    check: bool = True,
    merged: bool = False,
    fail_on_timeout: bool = True,
) -> subprocess.CompletedProcess:
    """Run a launcher command in a session of its own, from the checkout; returns the result (with
    ``merged``, stderr goes into stdout, in the order written).

    On a timeout every process of that session is killed — also ranks that a launcher put in process groups
    of their own (``mpirun`` does) — and the test fails with the output's end (without ``fail_on_timeout``
    the result comes back with ``returncode`` None). So are they when the test itself is interrupted
    (pytest-timeout, Ctrl-C). With ``check`` a non-zero exit fails the test too.
    """
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merged else subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        stdout, stderr = proc.communicate()
        stderr = stderr or ""
        if not fail_on_timeout:
            return subprocess.CompletedProcess(cmd, None, stdout, stderr)
        pytest.fail(
            f"{' '.join(cmd)} timed out after {timeout} s\n--- output (end)\n{(stdout + stderr)[-6000:]}"
        )
    except BaseException:
        kill_session(proc.pid)
        raise
    stderr = stderr or ""
    result = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    if check and proc.returncode != 0:
        output = (stdout + stderr)[-6000:]
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n--- output (end)\n{output}")
    return result


def kill_session(session: int) -> None:
    """SIGKILL every process whose session id is ``session``, and their descendants (torchrun starts its
    workers in sessions of their own)."""
    parents: dict[int, int] = {}
    doomed: set[int] = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp, session
        except OSError:
            continue
        pid = int(stat.parent.name)
        parents[pid] = int(fields[1])
        if int(fields[3]) == session:
            doomed.add(pid)
    while more := {pid for pid, parent in parents.items() if parent in doomed} - doomed:
        doomed |= more
    for pid in doomed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
