"""``python -m tests.gpu_check`` (``make gpu-check``), the check for a GPU machine, tested without a GPU:
one ``skipped: no GPU`` line per check, and the checks' own code run on the CPU (its self-test mode)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests import gpu_check, gpu_wheel
from tests.helpers import ROOT


def _run(*args: str, selftest: bool = False, timeout: float = 400) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "ADASUM_GPU_CHECK_SELFTEST"}
    if selftest:
        env["ADASUM_GPU_CHECK_SELFTEST"] = "cpu"
    return subprocess.run(
        [sys.executable, "-m", "tests.gpu_check", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=timeout,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: make gpu-check runs the checks")
def test_gpu_check_without_a_gpu_prints_one_skipped_line_per_check():
    proc = _run()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == [f"skipped: no GPU: {name}" for name, _ in gpu_check.CHECKS]


def test_gpu_check_checks_run_on_the_cpu_in_self_test_mode():
    names = [name for name, needs_horovod in gpu_check.CHECKS if not needs_horovod]
    if gpu_wheel.cached_wheel() is not None:  # the Horovod checks run in a scratch venv with the GPU wheel
        names = [name for name, _ in gpu_check.CHECKS]
    proc = _run("--only", *names, selftest=True)
    results = {}
    for line in proc.stdout.splitlines():
        status, rest = line.split(": ", 1)
        results[rest.split(":", 1)[0]] = status
    assert set(results) == set(names), proc.stdout + proc.stderr
    # SyncBatchNorm runs on GPUs only: on the CPU ddp_adasum refuses it before training (the expected failure)
    assert results.pop("sync_batchnorm") == "FAILED"
    assert "SyncBatchNorm runs on GPUs only" in proc.stdout
    assert set(results.values()) == {"ok"}, proc.stdout + proc.stderr
    assert proc.returncode == 1  # because of sync_batchnorm
