"""The reference step, computed in one process: each rank's local step of the tiny net from the common start,
then the Adasum of the ranks' deltas (``adasum_lightning.reference``). Every test of "one step is the
Adasum of the local deltas" — Horovod's strategies, ``ddp_adasum``, Fabric's, the plain loop — checks its
ranks against it.
The local-SGD windows with ``overlap_sync`` (each combined update applied one window late), likewise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from adasum_lightning.reference import adasum_reduce
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


def overlapped_local_sgd_reference(
    start: dict, rank_batches: list, sync_every: int, combine: str, outer_lr: float, wire=None
) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    """``overlap_sync=True`` written out in one process, as docs/local_sgd.md ("The sync behind compute")
    states it: inner SGD (lr 0.1, momentum 0.9) on each worker's batches; at the end of window k
    δ_k^r = θ^r − s^r, the pending C_{k−1} applied (g ← U(g, C_{k−1})), C_k = Combine(δ_k) pending, and
    θ^r = s^r = g + δ_k^r; at the end of training the flush. U: g + C, or an outer Nesterov SGD step
    (``outer_lr``, momentum 0.9) with −C as the gradient. ``wire``: None, or the dtype each δ and C are
    rounded to (two ranks: what ``compression`` sends). Returns each worker's parameters after each of its
    steps, and g after the flush."""
    models = [tiny_net() for _ in rank_batches]
    for m in models:
        m.load_state_dict(start)
    inner = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    g = [p.detach().clone() for p in models[0].parameters()]
    s = [[p.detach().clone() for p in m.parameters()] for m in models]
    outer_params = [torch.nn.Parameter(t.clone()) for t in g]
    outer = torch.optim.SGD(outer_params, lr=outer_lr or 1.0, momentum=0.9, nesterov=True)
    pending: list[torch.Tensor] | None = None

    def deltas() -> list[list[torch.Tensor]]:  # per rank, per parameter: θ^r − s^r
        return [
            [p.detach() - t for p, t in zip(m.parameters(), s_r, strict=True)]
            for m, s_r in zip(models, s, strict=True)
        ]

    def combined(d: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        sent = [[t.to(wire or t.dtype).float() for t in d_r] for d_r in d]
        per_parameter = [[sent[r][i] for r in range(len(d))] for i in range(len(g))]
        if combine == "adasum":
            c = [adasum_reduce(ds) for ds in per_parameter]
        else:
            c = [sum(ds) / len(ds) for ds in per_parameter]
        return [ci.to(wire or ci.dtype).float() for ci in c]

    def update(c: list[torch.Tensor]) -> None:  # g ← U(g, C)
        if not outer_lr:
            for t, ci in zip(g, c, strict=True):
                t.add_(ci)
            return
        for o, t, ci in zip(outer_params, g, c, strict=True):
            o.data.copy_(t)
            o.grad = -ci
        outer.step()
        for t, o in zip(g, outer_params, strict=True):
            t.copy_(o.detach())

    steps = len(rank_batches[0])
    trace: list[list[torch.Tensor]] = [[] for _ in models]
    for k in range(steps):
        for m, opt, batches in zip(models, inner, rank_batches, strict=True):
            x, y = batches[k]
            F.cross_entropy(m(x), y).backward()
            opt.step()
            opt.zero_grad()
        if (k + 1) % sync_every == 0:
            d = deltas()
            if pending is not None:
                update(pending)
            pending = combined(d)  # applied at the end of the next window: one window late
            with torch.no_grad():
                for r, m in enumerate(models):
                    for p, t, gi, di in zip(m.parameters(), s[r], g, d[r], strict=True):
                        p.copy_(gi + di)
                        t.copy_(p)
        for r, m in enumerate(models):
            trace[r].append(torch.cat([p.detach().reshape(-1) for p in m.parameters()]))
    # the flush at the end of training: the pending exchange, then the window cut short (if it has steps)
    d = deltas()
    if pending is not None:
        update(pending)
    if steps % sync_every:
        update(combined(d))
    return trace, torch.cat([t.reshape(-1) for t in g])
