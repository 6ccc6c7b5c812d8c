"""MNIST with Adasum in a Lightning Fabric loop: ``Fabric(strategy="ddp_adasum")``.

Two processes on this machine (Fabric starts the second one)::

    python examples/mnist_fabric.py --devices 2 --data-dir DIR

or under ``torchrun --nproc-per-node 2 examples/mnist_fabric.py --devices 2`` (or SLURM's ``srun``). The
model, data and hyperparameters are the Trainer example's (``examples/mnist.py``): the seed's CNN, SGD lr 0.01
momentum 0.5 (not multiplied by the number of processes), batch 64 per process, seed 42, 3 epochs. After
each epoch the ranks evaluate their shards of the test split together and rank 0 prints
``epoch=E val_acc=<fraction>``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from lightning_fabric import Fabric
from torch.utils.data import DataLoader

import adasum_lightning  # noqa: F401  (registers "ddp_adasum" with Fabric)

if __package__:  # imported as examples.mnist_fabric
    from .mnist_torch import MNISTCNN, MNISTFiles, normalize
else:  # run as a script
    from mnist_torch import MNISTCNN, MNISTFiles, normalize


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2, help="processes per node")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument(
        "--data-dir", default="data", help="torchvision root holding MNIST/raw/ (default: data)"
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--lr", type=float, default=0.01, help="not scaled by the number of processes")
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args(argv)


def evaluate(fabric: Fabric, model: torch.nn.Module, loader: DataLoader) -> float:
    """Accuracy over every rank's shard of ``loader``'s dataset (Fabric's all_reduce of the counts)."""
    model.eval()
    counts = torch.zeros(2, device=fabric.device)
    with torch.no_grad():
        for x, y in loader:
            counts += torch.tensor([(model(x).argmax(1) == y).sum().item(), len(y)], device=fabric.device)
    model.train()
    counts = fabric.all_reduce(counts, reduce_op="sum")
    return (counts[0] / counts[1]).item()


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    fabric = Fabric(
        accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes, strategy="ddp_adasum"
    )
    fabric.launch()
    fabric.seed_everything(args.seed)

    files = MNISTFiles(args.data_dir)
    if fabric.local_rank == 0:
        files.prepare()  # check, copy out of a read-only folder, extract: once per node
    fabric.barrier()
    train_set, test_set = files.datasets(normalize())
    train_loader, test_loader = fabric.setup_dataloaders(
        DataLoader(train_set, batch_size=args.batch_size, shuffle=True), DataLoader(test_set, batch_size=1000)
    )
    model = MNISTCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    # every rank takes rank 0's parameters; each optimizer.step() combines the ranks' updates by Adasum
    model, optimizer = fabric.setup(model, optimizer)
    accuracy = 0.0
    for epoch in range(args.epochs):
        for x, y in train_loader:
            optimizer.zero_grad()
            fabric.backward(F.nll_loss(model(x), y))
            optimizer.step()
        accuracy = evaluate(fabric, model, test_loader)
        fabric.print(f"epoch={epoch} val_acc={accuracy:.4f}")
    return accuracy


if __name__ == "__main__":
    main()
