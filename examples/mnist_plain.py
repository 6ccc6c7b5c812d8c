"""MNIST with Adasum in a plain PyTorch loop: ``AdasumOptimizer`` on ``torch.distributed``, no Lightning.

Two processes on this machine::

    torchrun --standalone --nproc-per-node 2 examples/mnist_plain.py --data-dir DIR

The model, data and hyperparameters are the Trainer example's (``examples/mnist.py``): the seed's CNN, SGD
lr 0.01 momentum 0.5 (not multiplied by the number of processes), batch 64 per process, seed 42, 3 epochs.
Each rank trains on its shard (a shuffling ``DistributedSampler``); after each epoch the ranks evaluate
their shards of the test split together and rank 0 prints ``epoch=E val_acc=<fraction>``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from adasum_lightning import AdasumOptimizer

if __package__:  # imported as examples.mnist_plain
    from .mnist_torch import MNISTCNN, MNISTFiles, normalize
else:  # run as a script
    from mnist_torch import MNISTCNN, MNISTFiles, normalize


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data-dir", default="data", help="torchvision root holding MNIST/raw/ (default: data)"
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--lr", type=float, default=0.01, help="not scaled by the number of processes")
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args(argv)


def evaluate(model: torch.nn.Module, loader: DataLoader) -> float:
    """Accuracy over every rank's shard of ``loader``'s dataset (an all_reduce of the counts)."""
    model.eval()
    counts = torch.zeros(2)
    with torch.no_grad():
        for x, y in loader:
            counts += torch.tensor([(model(x).argmax(1) == y).sum().item(), len(y)])
    model.train()
    dist.all_reduce(counts)
    return (counts[0] / counts[1]).item()


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)

    files = MNISTFiles(args.data_dir)
    if rank == 0:
        files.prepare()  # check, copy out of a read-only folder, extract: once
    dist.barrier()
    train_set, test_set = files.datasets(normalize())
    sampler = DistributedSampler(train_set, world_size, rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    test_sampler = DistributedSampler(test_set, world_size, rank, shuffle=False)
    test_loader = DataLoader(test_set, batch_size=1000, sampler=test_sampler)

    model = MNISTCNN()
    # every rank starts from rank 0's parameters; each step combines the ranks' updates by Adasum
    optimizer = AdasumOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum))
    accuracy = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in train_loader:
            optimizer.zero_grad()
            F.nll_loss(model(x), y).backward()
            optimizer.step()
        accuracy = evaluate(model, test_loader)
        if rank == 0:
            print(f"epoch={epoch} val_acc={accuracy:.4f}", flush=True)
    dist.destroy_process_group()
    return accuracy


if __name__ == "__main__":
    main()
