"""The package as a user installs it: ``python -m build`` gives an sdist and a wheel (built from that
sdist); the wheel goes into a new virtual environment in a temporary folder outside the repository, with
torch pinned by ``adasum_lightning/constraints.txt``, and works from there: ``import adasum_lightning``,
``adasum-aml``'s dry run (everything it needs is package data), ``--local 2`` of a user's project and of
the bundled MNIST example with ``ddp_adasum`` (the path with no compiler)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.wheel
VERSION = re.search(r'__version__ = "([^"]+)"', (ROOT / "adasum_lightning" / "__init__.py").read_text())[1]
#: What adasum-aml reads at run time, inside the wheel.
PACKAGE_DATA = (
    "adasum_lightning/constraints.txt",
    "adasum_lightning/aml/Dockerfile.in",
    "adasum_lightning/aml/Dockerfile.ddp.in",
    "adasum_lightning/aml/example/mnist.py",
    "adasum_lightning/aml/example/mnist_torch.py",
    "adasum_lightning/aml/horovod_build/build_horovod.sh",
    "adasum_lightning/aml/horovod_build/horovod-0.28.1-torch2.patch",
)
MNIST = ROOT.parent / "shared" / "data" / "MNIST" / "raw"


def _pins():
    lines = (ROOT / "adasum_lightning" / "constraints.txt").read_text().splitlines()
    return [line.split("==") for line in lines if line and not line.startswith("#")]


def _run(cmd, **kwargs):
    kwargs.setdefault("timeout", 600)
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)])
    return out


@pytest.fixture(scope="module")
def venv(dist, tmp_path_factory):
    """A new venv outside the repository with the wheel and its extras. torch, torchvision and their CUDA
    wheels are hard links of this environment's files (``.ci/seed_venv.py``: a third copy of them filled CI's
    disk); pip installs everything else from the registry, as for a user."""
    where = tmp_path_factory.mktemp("wheel-venv")
    assert ROOT not in where.parents
    _run([sys.executable, "-m", "venv", str(where / "venv")])
    python = where / "venv" / "bin" / "python"
    _run([sys.executable, str(ROOT / ".ci" / "seed_venv.py"), str(where / "venv")])
    (wheel,) = dist.glob("*.whl")
    start = time.monotonic()
    _run(
        [str(python), "-m", "pip", "install", "-q", "-c", str(ROOT / "adasum_lightning" / "constraints.txt"),
         f"{wheel}[aml-v2,lightning,examples]"],
    )  # fmt: skip
    print(f"[wheel] pip install of the wheel and the extras: {time.monotonic() - start:.0f} s")
    return python


def _environment():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "OMPI_COMM"))}
    return {**env, "OMP_NUM_THREADS": "1"}


def test_a_read_only_checkout_builds_the_wheel_and_stays_unchanged(tmp_path):
    # A copy of the checkout's files, bind-mounted read-only in a mount namespace of its own (root only):
    # setuptools' build/ and *.egg-info/ go to a scratch folder (setup.py), so pip builds the wheel there.
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare (a read-only bind mount)")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()  # fmt: skip
    source = tmp_path / "checkout"
    for name in files:
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    before = sorted(p.relative_to(source) for p in source.rglob("*"))
    wheel_dir = tmp_path / "wheel"
    pip_wheel = f"{sys.executable} -m pip wheel -q --no-deps --no-build-isolation -w {wheel_dir} {source}"
    build = f"mount --bind {source} {source} && mount -o remount,ro,bind {source} && {pip_wheel}"
    _run(["unshare", "--mount", "sh", "-c", build])
    (wheel,) = wheel_dir.glob("*.whl")
    assert wheel.name == f"adasum_lightning-{VERSION}-py3-none-any.whl"
    assert sorted(p.relative_to(source) for p in source.rglob("*")) == before


def test_sdist_and_wheel_hold_the_package_data(dist):
    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    assert wheel.name == f"adasum_lightning-{VERSION}-py3-none-any.whl"
    names = set(zipfile.ZipFile(wheel).namelist())
    assert set(PACKAGE_DATA) <= names
    info = f"adasum_lightning-{VERSION}.dist-info"
    assert {f"{info}/entry_points.txt", f"{info}/licenses/LICENSE"} <= names
    entry_points = zipfile.ZipFile(wheel).read(f"{info}/entry_points.txt").decode()
    assert "adasum-aml = adasum_lightning.aml.cli:main" in entry_points
    metadata = zipfile.ZipFile(wheel).read(f"{info}/METADATA").decode()
    assert "Requires-Python: <3.13,>=3.10" in metadata and "License: Apache-2.0" in metadata
    assert not any("tests/" in n or "__pycache__" in n for n in names)
    members = {m.split("/", 1)[1] for m in tarfile.open(sdist).getnames() if "/" in m}
    assert {"setup.py", "setup.cfg", "pyproject.toml", "LICENSE", "README.md", "examples/mnist.py"} <= members
    assert {"patches/build_horovod.sh", "adasum_lightning/constraints.txt"} <= members


def test_installed_wheel_imports_from_the_venv(venv, tmp_path):
    proc = _run(
        [str(venv), "-c",
         "import adasum_lightning, torch; print(adasum_lightning.__file__, torch.__version__)"],
        cwd=tmp_path, env=_environment(),
    )  # fmt: skip
    path, torch_version = proc.stdout.split()
    pinned = next(v for k, v in _pins() if k == "torch")
    assert Path(path).is_relative_to(venv.parent.parent) and torch_version.split("+")[0] == pinned


def test_installed_adasum_aml_dry_run_outside_the_checkout(venv, tmp_path):
    aml = venv.with_name("adasum-aml")
    proc = _run(
        [str(aml), "submit", "--dry-run", "--sdk", "v2", "--staging-dir", "st"],
        cwd=tmp_path,
        env=_environment(),
    )
    assert "command: python mnist.py fit --trainer.strategy=horovod_adasum" in proc.stdout
    image = tmp_path / "st" / "image"
    assert (image / f"adasum_lightning-{VERSION}-py3-none-any.whl").is_file()
    assert (image / "patches" / "build_horovod.sh").is_file() and (image / "constraints.txt").is_file()


def test_installed_adasum_horovodrun_without_horovod_names_the_packaged_build_script(venv, tmp_path):
    # The venv has no Horovod: one line naming the build script inside the installed package, no traceback.
    env = _environment()
    path = env["PATH"].split(os.pathsep)
    env["PATH"] = os.pathsep.join(d for d in path if not Path(d, "horovodrun").exists())
    proc = subprocess.run(
        [str(venv.with_name("adasum-horovodrun")), "-np", "2", str(venv), "-c", "pass"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    script = next(venv.parent.parent.glob("lib/python3*/site-packages/adasum_lightning/aml/horovod_build"))
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        f"adasum-horovodrun: error: horovodrun (Horovod's launcher) is not installed in the environment of "
        f"{venv}. Build Horovod against its torch with `bash {script / 'build_horovod.sh'} --python {venv}` "
        "(it needs Open MPI: the Debian/Ubuntu packages openmpi-bin and libopenmpi-dev), or use "
        "strategy='ddp_adasum', which needs no Horovod."
    )
    assert "Traceback" not in proc.stderr and (script / "build_horovod.sh").is_file()


def test_installed_adasum_aml_trains_a_users_project_locally(venv, tmp_path):
    shutil.copytree(ROOT / "tests" / "fixtures" / "aml_project", tmp_path / "project")
    shutil.copytree(ROOT / "tests" / "fixtures" / "aml_project_data", tmp_path / "points")
    aml = venv.with_name("adasum-aml")
    proc = _run(
        [str(aml), "submit", "--strategy", "ddp_adasum", "--local", "2", "--source-dir", "project",
         "train.py", "--input", "points=points", "--staging-dir", "st",
         "--", "--data-dir", "${{inputs.points}}"],
        cwd=tmp_path, env=_environment(),
    )  # fmt: skip
    assert "fixture trained: world_size=2 strategy=ddp_adasum" in proc.stdout


@pytest.mark.skipif(not MNIST.is_dir(), reason="real MNIST beside the checkout (../shared/data)")
def test_installed_wheel_runs_the_ddp_adasum_demo(venv, tmp_path):
    raw = tmp_path / "mnist" / "MNIST" / "raw"
    shutil.copytree(MNIST, raw)
    aml = venv.with_name("adasum-aml")
    proc = _run(
        [str(aml), "submit", "--strategy", "ddp_adasum", "--local", "2", "--local-batches", "100",
         "--data-dir", "mnist", "--staging-dir", "st"],
        cwd=tmp_path, env=_environment(),
    )  # fmt: skip
    accuracy = float(re.findall(r"val_acc=([0-9.]+)", proc.stdout + proc.stderr)[-1])
    assert accuracy > 0.5  # chance is 0.1; 100 batches of 64 per process on real MNIST give 0.75 here
