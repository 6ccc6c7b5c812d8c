"""Worker: the MNIST example's LightningCLI under a Horovod launch; every rank saves what it saw.

usage: python -m tests.workers.twohost_fit OUT_DIR [LightningCLI fit arguments...]

Runs ``examples.mnist.main(["fit", ...])`` and writes ``OUT_DIR/rank{r}.pt`` with this rank's placement
(Horovod's rank, local rank/size, cross rank/size, the host name, Lightning's view of the same), the
final parameters and what its logger did. The hosts share the filesystem, so every rank writes there.

``--trainer.callbacks+=tests.workers.twohost_fit.Progress`` adds :class:`Progress`: each rank writes its
latest global step to ``OUT_DIR/step-rank{r}`` (the lost-node tests cut the link once training runs).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch

from adasum_lightning.failure_detection import MPI_FAULT_SETTINGS


class Progress(pl.Callback):
    """After every training batch, ``OUT_DIR/step-rank{r}`` holds this rank's global step."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        path = Path(sys.argv[1]) / f"step-rank{trainer.global_rank}"
        path.with_suffix(".tmp").write_text(str(trainer.global_step))
        os.replace(path.with_suffix(".tmp"), path)
        if os.environ.get(
            "TWOHOST_CHATTY"
        ):  # every rank prints each step (output goes over mpirun's channel)
            print(f"rank {trainer.global_rank} step {trainer.global_step}", flush=True)


def record(cli) -> dict:
    import horovod.torch as hvd

    trainer = cli.trainer
    return {
        "host": socket.gethostname(),
        "rank": hvd.rank(),
        "size": hvd.size(),
        "local_rank": hvd.local_rank(),
        "local_size": hvd.local_size(),
        "cross_rank": hvd.cross_rank(),
        "cross_size": hvd.cross_size(),
        "homogeneous": hvd.mpi_ops._basics.is_homogeneous(),
        "ompi": {k: v for k, v in os.environ.items() if k.startswith("OMPI_COMM_WORLD")},
        "mca_env": {k: v for k, v in os.environ.items() if k.removeprefix("OMPI_MCA_") in MPI_FAULT_SETTINGS},
        # the process that started this rank: mpirun on the first host, an orted daemon on the others
        "parent": Path(f"/proc/{os.getppid()}/cmdline").read_bytes().replace(b"\0", b" ").decode(),
        "trainer": {
            "global_rank": trainer.global_rank,
            "local_rank": trainer.local_rank,
            "node_rank": trainer.node_rank,
            "world_size": trainer.world_size,
            "num_nodes": trainer.num_nodes,
            "is_global_zero": trainer.is_global_zero,
            "global_step": trainer.global_step,
        },
        "strategy": type(trainer.strategy).__name__,
        "logger_experiment": type(trainer.logger.experiment).__name__,
        "log_dir": trainer.logger.log_dir,
        "val_acc": float(trainer.callback_metrics.get("val_acc", float("nan"))),
        "params": {k: v.detach().clone() for k, v in cli.model.state_dict().items()},
    }


if __name__ == "__main__":
    from examples.mnist import main

    out = Path(sys.argv[1])
    result = record(main(["fit", *sys.argv[2:]]))
    torch.save(result, out / f"rank{result['rank']}.pt")
