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
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
import torchmetrics
from pytorch_lightning.cli import LightningCLI
from pytorch_lightning.loggers import CSVLogger
from pytorch_lightning.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader

import adasum_lightning  # noqa: F401  (registers "horovod_adasum", "horovod" and "ddp_adasum")
from adasum_lightning.checkpoint import READ_ERRORS, unreadable_checkpoint
from adasum_lightning.launch_environment import launcher_rank

if __package__:  # imported as examples.mnist (tests, benchmarks)
    from .mnist_torch import MNIST_MEAN, MNIST_STD, MNISTCNN, MNISTFiles, normalize
else:  # run as a script: python examples/mnist.py, or mnist.py in an Azure ML code snapshot
    from mnist_torch import MNIST_MEAN, MNIST_STD, MNISTCNN, MNISTFiles, normalize

__all__ = ["MNIST_MEAN", "MNIST_STD", "MNISTNet", "MNISTDataModule", "MNISTCLI", "main"]


class MNISTNet(MNISTCNN, pl.LightningModule):
    """The seed's standard MNIST CNN (:class:`examples.mnist_torch.MNISTCNN`) as a LightningModule: SGD,
    negative log-likelihood loss, validation accuracy.

    Args:
        lr: SGD learning rate (per process; not scaled by the world size under Adasum).
        momentum: SGD momentum.
    """

    def __init__(self, lr: float = 0.01, momentum: float = 0.5) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=10)

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


class MNISTDataModule(pl.LightningDataModule):
    """torchvision's MNIST: the 60k training split for training, the 10k test split for validation.

    ``data_dir`` is a torchvision root (:class:`examples.mnist_torch.MNISTFiles`: checked, copied to a
    writable cache when read-only, downloaded only when absent).

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
        self.files = MNISTFiles(data_dir)
        self.transform = normalize()

    def root(self) -> Path:
        """The torchvision root used for loading: ``data_dir`` when usable in place, else the cache."""
        return self.files.root()

    def prepare_data(self) -> None:
        self.files.prepare()

    def setup(self, stage: str) -> None:
        self.train_set, self.val_set = self.files.datasets(self.transform)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.eval_batch_size, num_workers=self.num_workers)


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
        except READ_ERRORS as err:
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
