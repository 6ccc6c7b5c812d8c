"""The MNIST example's model and data in plain PyTorch (no Lightning): shared by the Trainer example
(``examples/mnist.py``), the Fabric example (``examples/mnist_fabric.py``) and the plain loop
(``examples/mnist_plain.py``)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torchvision import datasets, transforms
from torchvision.datasets.utils import check_integrity

__all__ = ["MNIST_MEAN", "MNIST_STD", "MNISTCNN", "MNISTFiles", "normalize", "default_cache_dir"]

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


class MNISTCNN(nn.Module):
    """The seed's standard MNIST CNN.

    conv 1→10 (k5) → max-pool 2 → ReLU → conv 10→20 (k5) → Dropout2d → max-pool 2 → ReLU → flatten (320)
    → linear 50 → ReLU → dropout → linear 10 → log-softmax. Input ``(B, 1, 28, 28)`` float32 normalised
    with mean 0.1307 / std 0.3081; output ``(B, 10)`` log-probabilities; loss: negative log-likelihood.
    """

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.flatten(1)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


def normalize() -> transforms.Compose:
    """Image → ``(1, 28, 28)`` float32 tensor, normalised with MNIST's mean and standard deviation."""
    return transforms.Compose([transforms.ToTensor(), transforms.Normalize((MNIST_MEAN,), (MNIST_STD,))])


def default_cache_dir() -> Path:
    """Writable cache for data copied out of a read-only folder (``$ADASUM_DATA_CACHE`` overrides)."""
    base = os.environ.get("ADASUM_DATA_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "adasum-lightning", "data"
    )
    return Path(base)


class MNISTFiles:
    """Where torchvision's MNIST is read from.

    ``data_dir`` is a torchvision root: the four original ``.gz`` files (or their extracted forms) live in
    ``data_dir/MNIST/raw/``. Present files are MD5-checked and used offline; when ``data_dir`` is
    read-only they are copied into a writable cache first (:func:`default_cache_dir`). Files are
    downloaded only when absent.

    Raises:
        RuntimeError: from :meth:`prepare`: a ``.gz`` file fails its MD5 check (names the file), or the data
            is absent and cannot be downloaded (says where to put the four files).
    """

    def __init__(self, data_dir: str | os.PathLike = "data") -> None:
        self.data_dir = data_dir

    def _raw(self, root: Path) -> Path:
        return root / "MNIST" / "raw"

    def _extracted(self, root: Path) -> bool:
        raw = self._raw(root)
        return all(check_integrity(str(raw / Path(name).stem)) for name, _ in datasets.MNIST.resources)

    def root(self) -> Path:
        """The torchvision root used for loading: ``data_dir`` when usable in place, else the cache."""
        given = Path(self.data_dir).expanduser()
        if self._extracted(given) or _writable(self._raw(given)):
            return given
        return default_cache_dir()

    def prepare(self) -> None:
        """Check the files, copy them out of a read-only ``data_dir``, extract them (download if absent)."""
        given = Path(self.data_dir).expanduser()
        root = self.root()
        if self._extracted(root):
            return
        source = self._raw(given)
        for name, md5 in datasets.MNIST.resources:
            path = source / name
            if path.exists() and not check_integrity(str(path), md5):
                raise RuntimeError(
                    f"MNIST file {path} is corrupt (MD5 mismatch, expected {md5}). "
                    "Delete it to download a fresh copy, or replace it with the original file."
                )
        if root != given and all((source / name).exists() for name, _ in datasets.MNIST.resources):
            target = self._raw(root)
            target.mkdir(parents=True, exist_ok=True)
            for name, md5 in datasets.MNIST.resources:
                if not check_integrity(str(target / name), md5):
                    shutil.copyfile(source / name, target / name)
        try:
            # With the .gz files in place this only verifies and extracts them (no network).
            datasets.MNIST(str(root), train=True, download=True)
            datasets.MNIST(str(root), train=False, download=True)
        except RuntimeError as err:
            raise RuntimeError(
                f"MNIST is not in {self._raw(given)} and could not be downloaded "
                f"({str(err).splitlines()[0]}). "
                "Put the four original files (train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, "
                f"t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz) in {self._raw(given)}/ and rerun."
            ) from err

    def datasets(self, transform=None) -> tuple[datasets.MNIST, datasets.MNIST]:
        """The 60k training split and the 10k test split (call :meth:`prepare` first, once per machine)."""
        root = str(self.root())
        return (
            datasets.MNIST(root, train=True, transform=transform),
            datasets.MNIST(root, train=False, transform=transform),
        )


def _writable(path: Path) -> bool:
    """True when new files may go into ``path`` (or its nearest existing parent).

    A folder without write bits counts as read-only even for root, who could write there anyway: a
    shared, read-only data folder is never modified.
    """
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    return os.access(probe, os.W_OK) and bool(probe.stat().st_mode & 0o222)
