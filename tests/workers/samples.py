"""The tiny net and its data, without Lightning: the plain-torch workers import them in a torch-only
environment (``tests/workers/tiny.py`` builds the Lightning modules on them)."""

import torch
from torch import nn
from torch.utils.data import Dataset


class IndexedData(Dataset):
    """``n`` samples ``(x (8,) float32, y int64 in 0..3, index)``, identical on every rank (seed 0)."""

    def __init__(self, n: int = 64) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=gen)
        self.y = torch.randint(0, 4, (n,), generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


def tiny_net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
