"""MNIST with Horovod Adasum in PyTorch Lightning, driven by LightningCLI.

Two processes on this machine (Open MPI)::

    horovodrun -np 2 -H localhost:2 python examples/mnist.py fit \
        --trainer.strategy=horovod_adasum --trainer.max_epochs=3 \
        --data.data_dir=DIR --trainer.default_root_dir=OUT

or ``python examples/mnist.py fit --config examples/mnist.yaml``. The model and hyperparameters are the
seed example's (Horovod's ``examples/pytorch/pytorch_mnist.py``): SGD lr 0.01, momentum 0.5, batch 64
per process, seed 42. With Adasum the learning rate is *not* multiplied by the number of processes.
Metrics go to ``OUT/lightning_logs/version_N/metrics.csv``; rank 0 prints ``val_acc=<fraction>`` last.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
import torchmetrics
from pytorch_lightning.cli import LightningCLI
from pytorch_lightning.loggers import CSVLogger
from pytorch_lightning.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.utils.data import DataLoader
from torchvision import datasets, transforms
from torchvision.datasets.utils import check_integrity

import adasum_lightning  # noqa: F401  (registers "horovod_adasum", "horovod" and "ddp_adasum")
from adasum_lightning.launchers import launcher_rank
from adasum_lightning.validation import CHECKPOINT_READ_ERRORS, unreadable_checkpoint

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


class MNISTNet(pl.LightningModule):
    """The seed's standard MNIST CNN.

    conv 1→10 (k5) → max-pool 2 → ReLU → conv 10→20 (k5) → Dropout2d → max-pool 2 → ReLU → flatten (320)
    → linear 50 → ReLU → dropout → linear 10 → log-softmax. Input ``(B, 1, 28, 28)`` float32 normalised
    with mean 0.1307 / std 0.3081; output ``(B, 10)`` log-probabilities; loss: negative log-likelihood.

    Args:
        lr: SGD learning rate (per process; not scaled by the world size under Adasum).
        momentum: SGD momentum.
    """

    def __init__(self, lr: float = 0.01, momentum: float = 0.5) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.flatten(1)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.nll_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        log_probs = self(x)
        self.log("val_loss", F.nll_loss(log_probs, y), sync_dist=True, prog_bar=True)
        self.val_acc(log_probs, y)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)


def default_cache_dir() -> Path:
    """Writable cache for data copied out of a read-only folder (``$ADASUM_DATA_CACHE`` overrides)."""
    base = os.environ.get("ADASUM_DATA_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "adasum-lightning", "data"
    )
    return Path(base)


class MNISTDataModule(pl.LightningDataModule):
    """torchvision's MNIST: the 60k training split for training, the 10k test split for validation.

    ``data_dir`` is a torchvision root: the four original ``.gz`` files (or their extracted forms) live in
    ``data_dir/MNIST/raw/``. Present files are MD5-checked and used offline; when ``data_dir`` is
    read-only they are copied into a writable cache first (:func:`default_cache_dir`). Files are
    downloaded only when absent.

    Args:
        data_dir: torchvision root folder.
        batch_size: training batch per process.
        eval_batch_size: validation batch per process.
        num_workers: DataLoader workers per process.

    Raises:
        RuntimeError: a ``.gz`` file fails its MD5 check (names the file), or the data is absent and
            cannot be downloaded (says where to put the four files).
    """

    def __init__(
        self, data_dir: str = "data", batch_size: int = 64, eval_batch_size: int = 1000, num_workers: int = 0
    ) -> None:
        super().__init__()
        self.data_dir = data_dir
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.num_workers = num_workers
        self.transform = transforms.Compose(
            [transforms.ToTensor(), transforms.Normalize((MNIST_MEAN,), (MNIST_STD,))]
        )

    # -- where the data is -------------------------------------------------------------------------
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

    def prepare_data(self) -> None:
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

    def setup(self, stage: str) -> None:
        root = str(self.root())
        self.train_set = datasets.MNIST(root, train=True, transform=self.transform)
        self.val_set = datasets.MNIST(root, train=False, transform=self.transform)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.eval_batch_size, num_workers=self.num_workers)


def _writable(path: Path) -> bool:
    """True when new files may go into ``path`` (or its nearest existing parent).

    A folder without write bits counts as read-only even for root, who could write there anyway: a
    shared, read-only data folder is never modified.
    """
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    return os.access(probe, os.W_OK) and bool(probe.stat().st_mode & 0o222)


def default_logger(save_dir: str):
    """A CSVLogger under ``save_dir``; with ``MLFLOW_TRACKING_URI`` set (Azure ML jobs set it, and
    ``MLFLOW_RUN_ID``) also Lightning's MLFlowLogger, which logs from rank 0 only, to that run. Without the
    ``mlflow`` package the MLflow logger is skipped with a warning."""
    csv = CSVLogger(save_dir=save_dir)
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return csv
    from pytorch_lightning.loggers import MLFlowLogger

    try:
        mlflow = MLFlowLogger(
            experiment_name=os.environ.get("MLFLOW_EXPERIMENT_NAME", "lightning_logs"),
            tracking_uri=uri,
            run_id=os.environ.get("MLFLOW_RUN_ID"),
        )
    except ModuleNotFoundError as err:
        rank_zero_warn(f"MLFLOW_TRACKING_URI is set but MLflow logging is off: {err}")
        return csv
    return [csv, mlflow]


class MNISTCLI(LightningCLI):
    """LightningCLI with the seed's defaults: seed 42, a CSV logger under ``default_root_dir``, and a last
    line ``val_acc=<fraction>`` on rank 0 after ``fit``."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("seed_everything_default", 42)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        super().__init__(MNISTNet, MNISTDataModule, *args, **kwargs)

    def _parse_ckpt_path(self) -> None:
        # LightningCLI reads --ckpt_path itself (for the hyperparameters) before fit: give an unreadable
        # file the same clear error the strategy gives.
        try:
            super()._parse_ckpt_path()
        except CHECKPOINT_READ_ERRORS as err:
            ckpt_path = self.config[self.config.subcommand].get("ckpt_path")
            raise unreadable_checkpoint(ckpt_path, err, launcher_rank()) from err

    def instantiate_trainer(self, **kwargs):
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        if config["trainer"].get("logger") in (None, True):
            kwargs["logger"] = default_logger(config["trainer"].get("default_root_dir") or os.getcwd())
        return super().instantiate_trainer(**kwargs)

    def after_fit(self) -> None:
        acc = self.trainer.callback_metrics.get("val_acc")
        if acc is not None and self.trainer.is_global_zero:
            print(f"val_acc={float(acc):.4f}", flush=True)


def main(args: list[str] | None = None) -> MNISTCLI:
    """Run the CLI on ``args`` (default: the command line). One intra-op thread per process unless
    ``OMP_NUM_THREADS`` says otherwise: several processes share the cores."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    return MNISTCLI(args=args)


if __name__ == "__main__":
    main()
