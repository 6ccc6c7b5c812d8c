"""Local folders a job is made of: the Docker build context of its environment and its code snapshot.

Both backends upload these folders (SDK v1 at ``Experiment.submit`` / ``DockerBuildContext``, SDK v2 at
``jobs.create_or_update``); ``--dry-run`` shows their local paths and ``--local`` runs the snapshot.

- build context: ``Dockerfile`` and ``requirements.txt``. For the Horovod strategies (MPI jobs) the
  Dockerfile comes from ``Dockerfile.in`` and the context also holds ``patches/`` (this repository's
  ``patches/build_horovod.sh`` and Horovod patch, copied in; Horovod's own code is never copied: the script
  downloads its source distribution while the image is built). For ``ddp_adasum`` (PyTorch jobs) it comes
  from ``Dockerfile.ddp.in``: a CUDA runtime image with torch and the requirements, no MPI, no Horovod.
- code snapshot: ``mnist.py`` (``examples/mnist.py``, with its ``mnist_torch.py``) next to the
  ``adasum_lightning`` package, so the job's ``python mnist.py`` imports the same package version as the one
  that submitted it.
"""

from __future__ import annotations

import importlib.metadata
import shutil
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement

from adasum_lightning.aml.job import TRAINING_SCRIPT, AmlJob, AmlUsageError

#: Same pins as ``.ci/setup.sh`` (the versions the project is tested with).
TORCH_VERSION = "2.14.1"
TORCHVISION_VERSION = "0.29.1"
#: GPU compute capabilities Horovod's CUDA kernels are built for (T4, A100, A10/A40, L4, H100).
CUDA_CC_LIST = "75,80,86,89,90"
#: Extra packages of the job image besides the project's own requirements.
IMAGE_EXTRA_REQUIREMENTS = ("azureml-mlflow",)
#: The project's extras the training script needs (``examples``: torchvision, jsonargparse for LightningCLI).
IMAGE_EXTRAS = ("examples",)

PACKAGE_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = PACKAGE_DIR.parent
PATCHES_DIR = REPO_ROOT / "patches"
EXAMPLE_SCRIPT = REPO_ROOT / "examples" / "mnist.py"
#: The example's Lightning-free model and data, imported by ``mnist.py``; copied beside it.
EXAMPLE_MODULES = (REPO_ROOT / "examples" / "mnist_torch.py",)
DOCKERFILE_TEMPLATE = Path(__file__).resolve().with_name("Dockerfile.in")
#: The image of ``ddp_adasum`` jobs (no MPI, no Horovod).
DDP_DOCKERFILE_TEMPLATE = Path(__file__).resolve().with_name("Dockerfile.ddp.in")


@dataclass(frozen=True)
class StagedJob:
    """Folders prepared for one job.

    Attributes:
        code_dir: the code snapshot (``mnist.py`` + ``adasum_lightning/``); the job's working directory.
        context_dir: the Docker build context (``Dockerfile``, ``requirements.txt``, ``patches/``).
    """

    code_dir: Path
    context_dir: Path


def image_requirements() -> list[str]:
    """The project's install requirements and those of :data:`IMAGE_EXTRAS` (markers dropped), minus
    torch/torchvision (installed first, pinned), plus :data:`IMAGE_EXTRA_REQUIREMENTS`, as requirement
    strings."""
    reqs = []
    for line in importlib.metadata.requires("adasum-lightning") or []:
        req = Requirement(line)
        if req.marker is not None and "extra" in str(req.marker):
            if not any(req.marker.evaluate({"extra": extra}) for extra in IMAGE_EXTRAS):
                continue
            req.marker = None  # other markers stay: pip evaluates them in the image
        if req.name.lower() in ("torch", "torchvision"):
            continue
        if str(req) not in reqs:
            reqs.append(str(req))
    return reqs + list(IMAGE_EXTRA_REQUIREMENTS)


def dockerfile_template(job: AmlJob) -> Path:
    """``Dockerfile.in`` (Open MPI + Horovod) for MPI jobs, ``Dockerfile.ddp.in`` for ``ddp_adasum``."""
    return DOCKERFILE_TEMPLATE if job.is_mpi else DDP_DOCKERFILE_TEMPLATE


def render_dockerfile(job: AmlJob) -> str:
    """The job image's Dockerfile text for ``job.strategy`` and ``job.base_image``."""
    text = dockerfile_template(job).read_text(encoding="utf-8")
    for key, value in {
        "BASE_IMAGE": job.base_image,
        "TORCH_VERSION": TORCH_VERSION,
        "TORCHVISION_VERSION": TORCHVISION_VERSION,
        "CUDA_CC_LIST": CUDA_CC_LIST,
    }.items():
        text = text.replace(f"@{key}@", value)
    return text


def _require(path: Path, what: str) -> Path:
    if not path.exists():
        raise AmlUsageError(
            f"{what} {path} is missing: run adasum-aml from a checkout of adasum-lightning installed with "
            "`pip install -e '.[aml-v2]'` (the job image is built from the repository's patches/ folder)"
        )
    return path


def stage_build_context(job: AmlJob, dest: Path) -> Path:
    """Write the Docker build context into ``dest`` (created) and return it.

    Raises:
        AmlUsageError: for an MPI job, the repository's ``patches/`` folder (build script and patch) is not
            found.
    """
    if job.is_mpi:
        script = _require(PATCHES_DIR / "build_horovod.sh", "the Horovod build script")
        patches = sorted(PATCHES_DIR.glob("horovod-*.patch"))
        if not patches:
            _require(PATCHES_DIR / "horovod-<version>-torch2.patch", "the Horovod patch")
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "Dockerfile").write_text(render_dockerfile(job), encoding="utf-8")
    (dest / "requirements.txt").write_text("\n".join(image_requirements()) + "\n", encoding="utf-8")
    if job.is_mpi:
        (dest / "patches").mkdir(exist_ok=True)
        for src in (script, *patches):
            shutil.copy2(src, dest / "patches" / src.name)
    return dest


def stage_code(dest: Path) -> Path:
    """Write the code snapshot into ``dest`` (created) and return it.

    Raises:
        AmlUsageError: ``examples/mnist.py`` is not found beside the package.
    """
    script = _require(EXAMPLE_SCRIPT, "the training script")
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(script, dest / TRAINING_SCRIPT)
    for module in EXAMPLE_MODULES:
        shutil.copy2(_require(module, "the training script's model and data"), dest / module.name)
    shutil.copytree(
        PACKAGE_DIR,
        dest / "adasum_lightning",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
        dirs_exist_ok=True,
    )
    return dest


def stage_job(job: AmlJob, root: Path) -> StagedJob:
    """Stage both folders under ``root`` (``root/code``, ``root/image``)."""
    return StagedJob(stage_code(Path(root) / "code"), stage_build_context(job, Path(root) / "image"))
