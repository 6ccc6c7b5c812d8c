"""Horovod's GPU (NCCL) wheel, built here without a GPU from the registry's CUDA wheels (``make gpu-wheel``).

The wheel is installed into a scratch venv and inspected (``tests/gpu_wheel.py`` says what each check
proves). Skipped when this environment has no cached GPU wheel, unless ``ADASUM_REQUIRE_GPU_WHEEL=1`` (then a
missing wheel fails): ``make gpu-wheel`` builds it and ``.ci/run`` runs it before
``make test``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import gpu_wheel


def _wheel() -> Path:
    wheel = gpu_wheel.cached_wheel()
    if wheel is None:
        message = "no cached GPU wheel for this environment: `make gpu-wheel` builds it"
        if os.environ.get("ADASUM_REQUIRE_GPU_WHEEL") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return wheel


def _assert_ok(checks: dict, name: str) -> None:
    assert checks[name].ok, checks[name].line()


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    wheel = _wheel()
    report, checks = gpu_wheel.run_checks(wheel, tmp_path_factory.mktemp("gpu-wheel"))
    return wheel, report, {c.name: c for c in checks}


def test_gpu_wheel_is_cached_by_versions():
    wheel = _wheel()
    key = wheel.parent.name
    import torch

    assert key.startswith(
        f"horovod0.28.1-torch{torch.__version__.split('+')[0]}-cp{sys.version_info[0]}{sys.version_info[1]}-nccl-"
    )
    assert "-cuda13.0" in key and "-nccl2." in key and key.endswith("-cc75.80.86.89.90")
    log = (wheel.parent / "build.log").read_text(encoding="utf-8", errors="replace")
    assert "/usr/local/cuda" not in log  # the compile and link commands saw only the wheels' toolkit
    assert "-gencode arch=compute_75,code=sm_75" in log


def test_gpu_wheel_installs_into_a_scratch_environment(checked):
    wheel, report, checks = checked
    _assert_ok(checks, "installed in the scratch environment")
    assert not Path(report["horovod_file"]).is_relative_to(Path(sys.prefix))


def test_gpu_wheel_nccl_and_mpi_built(checked):
    _, report, checks = checked
    assert report["nccl_built"] >= 20000, report  # NCCL_VERSION_CODE: 2.30.7 -> 23007
    assert report["mpi_built"] and report["gloo_built"] and report["cuda_built"], report
    assert checks["hvd.nccl_built()"].ok and checks["hvd.mpi_built()"].ok


def test_gpu_wheel_imports_and_inits_without_a_gpu(checked):
    _, report, checks = checked
    _assert_ok(checks, "import horovod.torch and hvd.init() without a GPU")
    assert report["cuda_available"] is False and report["torch_cuda"].startswith("13.0")


def test_gpu_wheel_adasum_is_the_hierarchical_nccl_op(checked):
    _, _, checks = checked
    _assert_ok(checks, "Adasum on GPU tensors is the hierarchical NCCL op")


def test_gpu_wheel_has_kernels_for_the_azure_gpus(checked):
    _, _, checks = checked
    _assert_ok(checks, "CUDA kernels for T4, A100, A10/A40, L4, H100")


def test_gpu_wheel_uses_no_system_cuda(checked):
    _, report, checks = checked
    _assert_ok(checks, "no CUDA toolkit outside the wheels")
    # at run time the CUDA runtime and NCCL are torch's own wheels'
    assert any("nvidia/nccl/lib/libnccl.so" in p for p in report["loaded"]), report["loaded"]


def test_gpu_wheel_checks_fail_on_the_cpu_wheel(tmp_path):
    """The checks tell the builds apart: on the CPU wheel (`make setup`'s) the NCCL ones fail."""
    proc = subprocess.run(
        ["bash", str(gpu_wheel.BUILD_SCRIPT), "--cached-only", "--python", sys.executable],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip("no cached CPU wheel")
    _, checks = gpu_wheel.run_checks(Path(proc.stdout.strip().splitlines()[-1]), tmp_path)
    failed = {c.name for c in checks if not c.ok}
    assert {"hvd.nccl_built()", "Adasum on GPU tensors is the hierarchical NCCL op"} <= failed, failed
    assert "hvd.mpi_built()" not in failed


def test_gpu_wheel_script_last_line(checked):
    wheel, _, _ = checked
    proc = subprocess.run(
        [sys.executable, str(Path(gpu_wheel.__file__)), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == f"nccl_built=True {wheel}"
