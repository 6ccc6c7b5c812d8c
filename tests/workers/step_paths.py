"""Worker (torchrun): ``adasum_step`` and the bucket-by-bucket step during backward
(``BackwardAdasumStep``) against the reference step, bitwise, on every rank; OUT/rank{r}.pt.

usage: torchrun --nproc-per-node N -m tests.workers.step_paths OUT {sgd,adam} [bf16]

The reference is the step written out the plain way — ``before = clone``, ``p -= before``,
``adasum_allreduce(deltas)`` (packs and unpacks), ``p += before`` — which every earlier version ran. Both
run from the same parameters and optimizer state on the same local gradients for 4 steps; the model has a
frozen layer, a branch some ranks and steps do not use, a float64 parameter and a non-contiguous one. The
backward step's buckets hold at most 300 bytes here, so the model is cut into several (the float64 one
alone), completed in different orders on different ranks (the unused branch's only at ``finish``); its
ranks start from different values (it broadcasts rank 0's), and a layer unfrozen afterwards makes
``finish`` raise. ``bf16``: every path with ``wire_dtype=torch.bfloat16`` (the reference's allreduce too).
"""

import copy
import functools
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from adasum_lightning.allreduce import adasum_allreduce
from adasum_lightning.step import (
    BackwardAdasumStep,
    adasum_step,
    broadcast_from_rank_zero,
    optimizer_parameters,
)
from tests.workers import cases

argv = cases.argv()
out, optimizer_name = Path(argv[0]), argv[1]
wire = torch.bfloat16 if argv[2:] == ["bf16"] else None
cases.init_process_group("gloo")
rank = dist.get_rank()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)
        self.branch = nn.Linear(8, 4)  # used only on some steps and ranks
        self.scale = nn.Parameter(torch.ones(4, dtype=torch.float64))
        self.transposed = nn.Parameter(torch.randn(4, 16).t())  # non-contiguous (16, 4)

    def forward(self, x, use_branch):
        h = torch.tanh(self.body(self.frozen(x)))
        y = self.head(h) + (h @ self.transposed) * self.scale.float()
        return y + self.branch(x) if use_branch else y


def reference_step(params, local_step):
    with torch.no_grad():
        before = [p.detach().clone() for p in params]
    local_step()
    with torch.no_grad():
        deltas = [p.data for p in params]
        for d, b in zip(deltas, before, strict=True):
            d.sub_(b)
        adasum_allreduce(deltas, wire_dtype=wire)
        for d, b in zip(deltas, before, strict=True):
            d.add_(b)


def make(net):
    if optimizer_name == "adam":
        return torch.optim.Adam(net.parameters(), lr=0.01)
    return torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)


torch.manual_seed(rank)
net = Net()
broadcast_from_rank_zero([*net.parameters(), *net.buffers()])
twin, hooked = copy.deepcopy(net), copy.deepcopy(net)
if rank:
    with torch.no_grad():  # BackwardAdasumStep gives every rank rank 0's values when it is built
        for p in hooked.parameters():
            p.add_(1.0)
opt, twin_opt, hooked_opt = make(net), make(twin), make(hooked)
backward_step = BackwardAdasumStep(hooked_opt, dist.new_group(backend="gloo"), 300, wire_dtype=wire)
gen = torch.Generator().manual_seed(10 + rank)
for step in range(4):
    x, y = torch.randn(6, 8, generator=gen), torch.randint(0, 4, (6,), generator=gen)
    use_branch = (step + rank) % 2 == 0
    paths = ((net, opt, functools.partial(adasum_step, wire_dtype=wire)), (twin, twin_opt, reference_step))
    for model, optimizer, run in paths:
        optimizer.zero_grad()
        F.cross_entropy(model(x, use_branch), y).backward()
        run(optimizer_parameters(optimizer), optimizer.step)
    hooked_opt.zero_grad()
    F.cross_entropy(hooked(x, use_branch), y).backward()
    backward_step.finish()
identical = {
    name: torch.equal(a, b)
    for (name, a), (_, b) in zip(net.named_parameters(), twin.named_parameters(), strict=True)
}
identical_backward = {
    name: torch.equal(a, b)
    for (name, a), (_, b) in zip(hooked.named_parameters(), twin.named_parameters(), strict=True)
}
hooked.frozen.requires_grad_(True)  # a change the buckets were not built for: finish() says so
hooked_opt.zero_grad()
F.cross_entropy(hooked(x, True), y).backward()
try:
    backward_step.finish()
    changed_error = None
except RuntimeError as err:
    changed_error = str(err)
torch.save(
    {
        "identical": identical,
        "identical_backward": identical_backward,
        "changed_error": changed_error,
        "buckets": len(backward_step.buckets),
        "end": {k: v.clone() for k, v in net.state_dict().items()},
    },
    out / f"rank{rank}.pt",
)
cases.destroy_process_group()
