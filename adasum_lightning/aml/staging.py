"""The local folders a job is made of: its image's Docker build context and its code snapshot.

Both come from the installed package. The build context holds the wheel of the installed adasum-lightning, so
the job runs the version that submitted it; :func:`content_version` names the image by its content.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.resources
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from adasum_lightning.aml.errors import AmlUsageError
from adasum_lightning.aml.job import TRAINING_SCRIPT, AmlJob
from adasum_lightning.aml.project import copy_snapshot
from adasum_lightning.horovod.support import HOROVOD_BUILD_PACKAGE

#: GPU compute capabilities Horovod's CUDA kernels are built for (T4, A100, A10/A40, L4, H100).
CUDA_CC_LIST = "75,80,86,89,90"
#: Extra packages of the job image besides adasum-lightning and the project's own requirements.
IMAGE_EXTRA_REQUIREMENTS = ("azureml-mlflow",)
#: The extras of adasum-lightning the image installs: ``examples`` (torchvision, LightningCLI's jsonargparse)
#: and ``lightning`` (for scripts that ``import lightning``).
IMAGE_EXTRAS = "examples,lightning"
DISTRIBUTION = "adasum-lightning"
#: Packages of the bundled files (``setup.py`` maps ``examples/`` and ``patches/`` there).
EXAMPLE_PACKAGE = "adasum_lightning.aml.example"
#: The example's files in the snapshot: the LightningCLI script and its Lightning-free model and data.
EXAMPLE_FILES = (TRAINING_SCRIPT, "mnist_torch.py")
#: Files of an installed ``.dist-info`` that describe the installation, not the package.
_INSTALL_RECORDS = ("INSTALLER", "REQUESTED", "direct_url.json", "RECORD")
#: Wheel timestamps (the zip format's earliest date) so that the same files give the same wheel bytes.
_SOURCE_DATE_EPOCH = "315532800"


@dataclass(frozen=True)
class StagedJob:
    """Folders prepared for one job: the code snapshot (the job's working directory) and its files (POSIX
    paths), the Docker build context and its :func:`content_version` (``None`` for a registered environment).
    """

    code_dir: Path
    context_dir: Path | None
    environment_version: str | None = None
    files: tuple[str, ...] = ()


def package_file(package: str, name: str) -> Path:
    """A file shipped inside the installed package (wheel or checkout alike)."""
    path = Path(str(importlib.resources.files(package).joinpath(name)))
    if not path.is_file():
        raise AmlUsageError(
            f"{name} is missing from the installed {package}: reinstall adasum-lightning "
            "(pip install --force-reinstall adasum-lightning)"
        )
    return path


def constraints() -> dict[str, str]:
    """The pinned versions of ``adasum_lightning/constraints.txt``: ``{"torch": "2.14.1", ...}``."""
    text = package_file("adasum_lightning", "constraints.txt").read_text(encoding="utf-8")
    pins = [line.partition("==") for line in map(str.strip, text.splitlines()) if line and line[0] != "#"]
    return {name.strip().lower(): version.strip() for name, _, version in pins}


def image_dependencies() -> dict[str, list]:
    """What the image's wheel requires, with :data:`IMAGE_EXTRAS`: ``{lowercase name: [SpecifierSet, …]}``."""
    from packaging.requirements import Requirement

    extras = ["", *IMAGE_EXTRAS.split(",")]
    wanted: dict[str, list] = {}
    for req in map(Requirement, _installed_distribution().requires or []):
        if req.marker is None or any(req.marker.evaluate({"extra": extra}) for extra in extras):
            wanted.setdefault(req.name.lower(), []).append(req.specifier)
    return wanted


def render_dockerfile(job: AmlJob, wheel_name: str) -> str:
    """The job image's Dockerfile: ``Dockerfile.in`` (Open MPI + Horovod) for MPI jobs, ``Dockerfile.ddp.in``
    for ``ddp_adasum``, with ``job.base_image`` and the staged wheel."""
    template = package_file("adasum_lightning.aml", "Dockerfile.in" if job.is_mpi else "Dockerfile.ddp.in")
    text = template.read_text(encoding="utf-8")
    values = {
        "BASE_IMAGE": job.base_image,
        "CUDA_CC_LIST": CUDA_CC_LIST,
        "WHEEL": wheel_name,
        "EXTRAS": IMAGE_EXTRAS,
    }
    for key, value in values.items():
        text = text.replace(f"@{key}@", value)
    return text


def _installed_distribution() -> importlib.metadata.Distribution:
    """The installed ``.dist-info`` of adasum-lightning (the one pip wrote, with a ``WHEEL`` file)."""
    for dist in importlib.metadata.distributions(name=DISTRIBUTION):
        if dist.read_text("WHEEL") is not None:
            return dist
    raise AmlUsageError(
        "adasum-lightning is imported but not installed: pip install 'adasum-lightning[aml-v2]' (or, in a "
        "checkout, pip install -e '.[aml-v2]')"
    )


def _digest(root: Path, digest, skip: str = "") -> None:
    """Add every file under ``root`` but ``*skip`` (its POSIX path and bytes, in order) to ``digest``."""
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not (skip and p.name.endswith(skip))):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")


def build_wheel(dest: Path) -> tuple[Path, str]:
    """Build the wheel of the installed adasum-lightning (editable or not) into ``dest`` with ``wheel pack``.

    Returns:
        The wheel's path and the SHA-256 of its unpacked files.

    Raises:
        AmlUsageError: adasum-lightning is not installed as a distribution, or ``wheel`` is missing (names the
            pip extra).
    """
    dist, ignore = _installed_distribution(), shutil.ignore_patterns("__pycache__", "*.pyc")
    with tempfile.TemporaryDirectory(prefix="adasum-wheel-") as tmp:
        tree = Path(tmp) / "tree"  # the package and its .dist-info: an unpacked wheel
        shutil.copytree(
            str(importlib.resources.files("adasum_lightning")), tree / "adasum_lightning", ignore=ignore
        )
        for name in (EXAMPLE_PACKAGE, HOROVOD_BUILD_PACKAGE):  # an editable install maps these from elsewhere
            target = tree.joinpath(*name.split("."))
            shutil.copytree(str(importlib.resources.files(name)), target, ignore=ignore, dirs_exist_ok=True)
        info = Path(str(dist.locate_file(f"{DISTRIBUTION.replace('-', '_')}-{dist.version}.dist-info")))
        shutil.copytree(info, tree / info.name, ignore=shutil.ignore_patterns(*_INSTALL_RECORDS))
        digest = hashlib.sha256()
        _digest(tree, digest)
        dest.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "wheel", "pack", str(tree), "-d", str(dest)]
        env = {**os.environ, "SOURCE_DATE_EPOCH": _SOURCE_DATE_EPOCH}
        done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0 and "No module named wheel" in done.stderr:
        raise AmlUsageError(
            "building the job's adasum-lightning wheel needs the wheel package: pip install "
            "'adasum-lightning[aml-v2]' (or [aml]), which brings it"
        )
    if done.returncode != 0:
        raise AmlUsageError(f"wheel pack failed: {done.stderr.strip().splitlines()[-1:]}")
    return sorted(dest.glob("adasum_lightning-*.whl"))[-1], digest.hexdigest()


def content_version(context_dir: Path, wheel_digest: str) -> str:
    """The environment version: 16 hex digits of the build context's SHA-256, the wheel by its content."""
    digest = hashlib.sha256(wheel_digest.encode())
    _digest(context_dir, digest, skip=".whl")
    return digest.hexdigest()[:16]


def stage_build_context(job: AmlJob, dest: Path) -> tuple[Path, str]:
    """Write the Docker build context into ``dest`` (created); returns it and its :func:`content_version`."""
    wheel, wheel_digest = build_wheel(dest)
    (dest / "Dockerfile").write_text(render_dockerfile(job, wheel.name), encoding="utf-8")
    shutil.copy2(package_file("adasum_lightning", "constraints.txt"), dest / "constraints.txt")
    requirements = "\n".join([*IMAGE_EXTRA_REQUIREMENTS, *job.requirements]) + "\n"
    (dest / "requirements.txt").write_text(requirements, encoding="utf-8")
    if job.is_mpi:
        (dest / "patches").mkdir(exist_ok=True)
        script = package_file(HOROVOD_BUILD_PACKAGE, "build_horovod.sh")
        for src in [script, *sorted(script.parent.glob("horovod-*.patch"))]:
            shutil.copy2(src, dest / "patches" / src.name)
    return dest, content_version(dest, wheel_digest)


def stage_code(job: AmlJob, dest: Path, source_dir: Path | None = None) -> tuple[Path, tuple[str, ...]]:
    """Write the code snapshot into ``dest`` (created): the source directory's files, or the bundled example;
    returns ``dest`` and the files."""
    dest.mkdir(parents=True, exist_ok=True)
    if job.script is None:
        for name in EXAMPLE_FILES:
            shutil.copy2(package_file(EXAMPLE_PACKAGE, name), dest / name)
        return dest, EXAMPLE_FILES
    if source_dir is None:
        raise AmlUsageError(f"the script {job.script} needs its source directory: pass --source-dir")
    return dest, tuple(copy_snapshot(Path(source_dir), dest, job.script))


def stage_job(job: AmlJob, root: Path, source_dir: Path | None = None) -> StagedJob:
    """Stage ``root/code`` and ``root/image``; no image for a job that uses a registered environment."""
    code_dir, files = stage_code(job, Path(root) / "code", source_dir)
    if job.environment is not None:
        return StagedJob(code_dir, None, None, files)
    context_dir, version = stage_build_context(job, Path(root) / "image")
    return StagedJob(code_dir, context_dir, version, files)
