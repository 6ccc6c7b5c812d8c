"""The reference step, computed in one process: each rank's local step of the tiny net from the common start,
then the Adasum of the ranks' deltas (``adasum_lightning.ops``). Every test of "one step is the Adasum of the
local deltas" — Horovod's strategies, ``ddp_adasum``, Fabric's, the plain loop — checks its ranks against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from adasum_lightning.ops import adasum_reduce
from tests.workers.tiny import tiny_net


def strip(state: dict) -> dict:
    """A LightningModule's state dict under the tiny net's own names (``net.`` dropped)."""
    return {k.removeprefix("net."): v for k, v in state.items()}


def local_delta(
    start: dict,
    batches: list,
    *,
    lr: float = 0.1,
    momentum: float = 0.5,
    optimizer: str = "sgd",
    loss_scale: float = 1.0,
    clip_norm: float | None = None,
    clip_value: float | None = None,
    bf16: bool = False,
) -> dict:
    """One rank's local step of the tiny net from ``start`` on the mean loss of ``batches`` (Lightning divides
    each micro-batch's loss by their number), clipped as asked: ``{name: new − start}``. LBFGS steps on the
    first batch with a closure (5 iterations)."""
    net = tiny_net()
    net.load_state_dict(start)
    if optimizer == "lbfgs":
        opt = torch.optim.LBFGS(net.parameters(), lr=lr, max_iter=5)
        x, y = batches[0]

        def closure():
            opt.zero_grad()
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            return loss

        opt.step(closure)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
        for x, y in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = F.cross_entropy(net(x), y) * loss_scale / len(batches)
            loss.backward()
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip_norm)
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(net.parameters(), clip_value)
        opt.step()
    return {k: v.detach() - start[k] for k, v in net.state_dict().items()}


def assert_one_step_is_the_adasum_of_local_deltas(
    ranks: list[dict], deltas: list[dict], rtol=1e-5, atol=1e-7
):
    """Every rank's parameters after one step equal the common start plus the Adasum of ``deltas``."""
    start = strip(ranks[0]["start"])
    for r, res in enumerate(ranks):
        for name, end in strip(res["end"]).items():
            expected = start[name] + adasum_reduce([d[name] for d in deltas])
            assert torch.allclose(end, expected, rtol=rtol, atol=atol), (
                r,
                name,
                (end - expected).abs().max(),
            )
