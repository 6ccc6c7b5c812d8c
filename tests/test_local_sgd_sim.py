"""The DiLoCo / local SGD simulator (benchmarks/local_sgd.py): its arithmetic on cases with known values, its
batched workers against separate ones, the byte counts, and (when torchft is installed) torchft's DiLoCo."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.local_sgd import (
    adasum_allreduce_bytes,
    bytes_per_round,
    combine_deltas,
    ring_allreduce_bytes,
    simulate_diloco,
)
from examples.mnist_torch import MNISTCNN

# Worker 0 sees x = e0, worker 1 x = e1, target 0, for w·x with w = (1, 2): squared-error gradients
# 2 (w·x − 0) x are (2, 0) and (0, 4); with lr 0.1 the pseudo-gradients are (−0.2, 0) and (0, −0.4),
# orthogonal.
E0, E1 = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])


def _linear() -> nn.Module:
    m = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        m.weight.copy_(torch.tensor([[1.0, 2.0]]))
    return m


def _fixed(x: torch.Tensor):
    return lambda step: (x, torch.zeros(1, 1))


def _sgd(lr: float = 0.1, momentum: float = 0.0):
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum)


def _weight(shards, combine: str, outer=None, rounds: int = 1, sync_every: int = 1, **kw) -> list[float]:
    out = simulate_diloco(_linear, shards, sync_every=sync_every, combine=combine, inner_optimizer_fn=_sgd(),
                          outer_optimizer_fn=outer, rounds=rounds, loss_fn=F.mse_loss, **kw)  # fmt: skip
    return out["model"].weight.detach().flatten().tolist()


def test_mean_with_h1_plain_sgd_and_no_outer_optimizer_is_one_sgd_step_on_the_averaged_gradient():
    # averaged gradient (1, 2): w = (1, 2) − 0.1 · (1, 2)
    assert _weight([_fixed(E0), _fixed(E1)], "mean") == pytest.approx([0.9, 1.8], abs=1e-7)


def test_adasum_of_orthogonal_pseudo_gradients_adds_them_and_of_equal_ones_keeps_one():
    assert _weight([_fixed(E0), _fixed(E1)], "adasum") == pytest.approx([0.8, 1.6], abs=1e-7)
    assert _weight([_fixed(E0), _fixed(E0)], "adasum") == pytest.approx([0.8, 2.0], abs=1e-7)
    assert _weight([_fixed(E0), _fixed(E0)], "mean") == pytest.approx([0.8, 2.0], abs=1e-7)


def test_outer_optimizer_gets_minus_the_combined_pseudo_gradient():
    plain = lambda params: torch.optim.SGD(params, lr=1.0)  # noqa: E731
    assert _weight([_fixed(E0), _fixed(E1)], "mean", plain) == pytest.approx([0.9, 1.8], abs=1e-7)
    # Nesterov, momentum 0.9, first step: buffer g, update g + 0.9 g: θ += 0.7 · 1.9 · Δ, Δ = (−0.1, −0.2)
    nesterov = lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)  # noqa: E731
    assert _weight([_fixed(E0), _fixed(E1)], "mean", nesterov) == pytest.approx([0.867, 1.734], abs=1e-6)


def test_batched_workers_equal_separate_models_and_optimizers_with_state_kept_across_rounds():
    torch.manual_seed(0)
    template = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    init = {k: v.clone() for k, v in template.state_dict().items()}
    data = [(torch.randn(6, 5), torch.randint(0, 3, (6,))) for _ in range(2 * 3 * 2)]  # worker, step

    def model_fn() -> nn.Module:
        m = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
        m.load_state_dict(init)
        return m

    shards = [lambda step, w=w: data[w * 6 + step] for w in range(2)]
    adamw = lambda params: torch.optim.AdamW(params, lr=0.05)  # noqa: E731
    nesterov = lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)  # noqa: E731
    for combine in ("mean", "adasum"):
        got = simulate_diloco(model_fn, shards, sync_every=3, combine=combine, inner_optimizer_fn=adamw,
                              outer_optimizer_fn=nesterov, rounds=2)["model"]  # fmt: skip
        # reference: two models, two AdamW, one Nesterov on θ_sync, written out
        sync = model_fn()
        outer = nesterov(list(sync.parameters()))
        workers = [model_fn() for _ in range(2)]
        inners = [adamw(list(m.parameters())) for m in workers]
        step = 0
        for _ in range(2):
            for _ in range(3):
                for w, (m, opt) in enumerate(zip(workers, inners, strict=True)):
                    opt.zero_grad()
                    F.cross_entropy(m(data[w * 6 + step][0]), data[w * 6 + step][1]).backward()
                    opt.step()
                step += 1
            with torch.no_grad():
                for ps in zip(sync.parameters(), *(m.parameters() for m in workers), strict=True):
                    ps[0].grad = -combine_deltas([p - ps[0] for p in ps[1:]], combine)
                outer.step()
                for m in workers:
                    m.load_state_dict(sync.state_dict())
        for a, b in zip(got.parameters(), sync.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_each_worker_draws_its_own_dropout_masks():
    # Both workers see the same batches from the same θ_sync: their pseudo-gradients differ only through
    # dropout. Adasum of two equal vectors is the vector, so Adasum equals the mean exactly when the masks
    # are shared, and differs when each worker draws its own.
    torch.manual_seed(0)
    init = {k: v.clone() for k, v in MNISTCNN().state_dict().items()}

    def model_fn() -> nn.Module:
        m = MNISTCNN()
        m.load_state_dict(init)
        return m

    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    shards = [lambda step: (x, y)] * 2

    def run(combine: str, model: Callable[[], nn.Module]) -> torch.Tensor:
        torch.manual_seed(1)
        out = simulate_diloco(model, shards, sync_every=2, combine=combine, inner_optimizer_fn=_sgd(),
                              outer_optimizer_fn=None, rounds=1, loss_fn=F.nll_loss)  # fmt: skip
        return torch.cat([p.detach().flatten() for p in out["model"].parameters()])

    start = torch.cat([v.flatten() for k, v in init.items()])
    adasum, mean = run("adasum", model_fn), run("mean", model_fn)
    assert (adasum - mean).abs().max() > 1e-4 * (mean - start).abs().max()

    # the same model in eval mode (dropout off): the workers are identical, Adasum is the mean
    def without_dropout() -> nn.Module:
        return model_fn().eval()

    adasum, mean = run("adasum", without_dropout), run("mean", without_dropout)
    torch.testing.assert_close(adasum, mean, rtol=0, atol=1e-7)


def test_overlap_applies_each_combined_update_one_window_late_from_the_eager_point():
    # H = 1, mean, no outer optimizer; worker w only moves w_w by −0.2 w_w. Window 0: Δ = (−0.1, −0.2),
    # the workers go on from (0.8, 2) and (1, 1.6); window 1 applies it (g = (0.9, 1.8)), its Δ from those
    # points is (−0.08, −0.16); window 2: g = (0.82, 1.64), Δ = (−0.074, −0.148); the flush: (0.746, 1.492).
    # Without overlap every window multiplies w by 0.9: (0.729, 1.458).
    shards = [_fixed(E0), _fixed(E1)]
    assert _weight(shards, "mean", rounds=3, overlap=True) == pytest.approx([0.746, 1.492], abs=1e-6)
    assert _weight(shards, "mean", rounds=3) == pytest.approx([0.729, 1.458], abs=1e-6)
    # Adasum adds the orthogonal changes, and each worker's own coordinate is then already up to date
    assert _weight(shards, "adasum", rounds=3, overlap=True) == pytest.approx([0.512, 1.024], abs=1e-6)


def test_overlap_equals_the_algorithm_written_out_and_evaluates_the_flushed_point():
    """docs/local_sgd.md's overlap_sync, step by step, with separate models: 3 workers, AdamW inner, 3
    windows of 2 steps, with a Nesterov outer optimizer and without; the evaluation after window r is the
    final point of a run of r windows."""
    torch.manual_seed(2)
    template = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    init = {k: v.clone() for k, v in template.state_dict().items()}
    n, h, windows = 3, 2, 3
    data = [[(torch.randn(6, 5), torch.randint(0, 3, (6,))) for _ in range(h * windows)] for _ in range(n)]
    val = (torch.randn(16, 5), torch.randint(0, 3, (16,)))

    def model_fn() -> nn.Module:
        m = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
        m.load_state_dict(init)
        return m

    def val_loss(m: nn.Module) -> float:
        return F.cross_entropy(m(val[0]), val[1]).item()

    adamw = lambda params: torch.optim.AdamW(params, lr=0.05)  # noqa: E731
    nesterov = lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)  # noqa: E731

    def written_out(combine: str, outer_fn, rounds: int) -> nn.Module:
        g = model_fn()  # the global point
        outer = outer_fn(list(g.parameters())) if outer_fn else None
        workers = [model_fn() for _ in range(n)]
        inners = [adamw(list(m.parameters())) for m in workers]
        starts = [[p.detach().clone() for p in m.parameters()] for m in workers]
        pending = None

        def apply(c: list[torch.Tensor]) -> None:  # g ← U(g, C)
            for gp, cp in zip(g.parameters(), c, strict=True):
                if outer is None:
                    gp.add_(cp)
                else:
                    gp.grad = -cp
            if outer is not None:
                outer.step()
                outer.zero_grad()

        for k in range(rounds):
            for step in range(k * h, (k + 1) * h):
                for w, (m, opt) in enumerate(zip(workers, inners, strict=True)):
                    opt.zero_grad()
                    F.cross_entropy(m(data[w][step][0]), data[w][step][1]).backward()
                    opt.step()
            with torch.no_grad():
                deltas = [[p - s for p, s in zip(m.parameters(), st, strict=True)]
                          for m, st in zip(workers, starts, strict=True)]  # fmt: skip
                if pending is not None:
                    apply(pending)
                pending = [combine_deltas([d[i] for d in deltas], combine) for i in range(len(deltas[0]))]
                for m, d, st in zip(workers, deltas, starts, strict=True):
                    for p, gp, dp, s in zip(m.parameters(), g.parameters(), d, st, strict=True):
                        p.copy_(gp + dp)
                        s.copy_(p)
        with torch.no_grad():
            apply(pending)  # the flush
        return g

    shards = [lambda step, w=w: data[w][step] for w in range(n)]
    for combine in ("mean", "adasum"):
        for outer_fn in (nesterov, None):
            got = simulate_diloco(model_fn, shards, sync_every=h, combine=combine, inner_optimizer_fn=adamw,
                                  outer_optimizer_fn=outer_fn, rounds=windows, eval_fn=val_loss,
                                  overlap=True)  # fmt: skip
            refs = [written_out(combine, outer_fn, r) for r in range(1, windows + 1)]
            for a, b in zip(got["model"].parameters(), refs[-1].parameters(), strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
            assert [v for _, v in got["history"][1:]] == pytest.approx([val_loss(m) for m in refs], abs=1e-6)
            plain = simulate_diloco(model_fn, shards, sync_every=h, combine=combine, inner_optimizer_fn=adamw,
                                    outer_optimizer_fn=outer_fn, rounds=windows)["model"]  # fmt: skip
            moved = max(
                (a - b).abs().max().item()
                for a, b in zip(got["model"].parameters(), plain.parameters(), strict=True)
            )
            assert moved > 1e-3  # overlap is not the plain algorithm


def test_bf16_wire_moves_the_combination_by_less_than_its_rounding_bound_and_not_zero():
    # The fixed case: Δ_w = (−0.2, 0), (0, −0.4) travel as bfloat16 −0.2001953125 and −0.400390625
    shards = [_fixed(E0), _fixed(E1)]
    bf16 = {"compression": "bf16"}
    assert _weight(shards, "adasum", **bf16) == [0.7998046875, 1.599609375]
    assert _weight(shards, "mean", **bf16) == [0.89990234375, 1.7998046875]
    # Random deltas, u = 2^-8. Mean (elementwise): rounded inputs move it by ≤ u·mean|x_w|, the final
    # rounding by ≤ u·|result|. Adasum of two (norms): rounded inputs move each projection term by
    # ≤ 2u‖·‖, so the result by ≤ 2u(‖a‖ + ‖b‖), the final rounding by ≤ u‖result‖.
    u = 2.0**-8
    torch.manual_seed(3)
    xs = [torch.randn(4096) * (w + 1) + 0.5 for w in range(4)]
    exact, wire = combine_deltas(xs, "mean"), combine_deltas(xs, "mean", "bf16")
    bound = u * (torch.stack(xs).abs().mean(0) + wire.abs()) + 1e-6
    assert ((wire - exact).abs() <= bound).all()
    assert (wire != exact).float().mean() > 0.9
    exact, wire = combine_deltas(xs[:2], "adasum"), combine_deltas(xs[:2], "adasum", "bf16")
    bound = u * (2 * (xs[0].norm() + xs[1].norm()) + wire.norm())
    assert 0.05 * bound < (wire - exact).norm() <= bound
    assert wire.dtype == torch.float32 and wire.to(torch.bfloat16).float().equal(wire)


def test_bytes_per_rank():
    # binomial tree (small bucket), N = 4, B = 40 bytes: rank 0 sends down twice, rank 2 up once and down
    # once, ranks 1 and 3 up once; on average 2 (N−1)/N · B, like the ring
    assert adasum_allreduce_bytes([10], 4, 4) == [80, 40, 80, 40]
    assert ring_allreduce_bytes(40, 4) == 60
    # vector halving (16 MiB × log2 4 > 8 MB): halves 8 + 4 MiB out, 4 + 8 MiB back, plus the float64
    # statistics (1 tensor × 3 × 8 bytes: one swap at d = 1, two at d = 2)
    mib = 1 << 20
    assert adasum_allreduce_bytes([4 * mib], 4, 4) == [24 * mib + 72] * 4
    # N = 3: rank 2 folds into rank 0 and gets the result back; ranks 0, 1 form the tree
    assert adasum_allreduce_bytes([10], 4, 3) == [80, 40, 40]
    mlp = nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
    b = bytes_per_round(mlp, 16, "adasum")
    assert (b["param_bytes"], b["algorithm"], b["max_per_rank"]) == (407_080, "tree", 4 * 407_080)
    assert b["mean_per_rank"] == pytest.approx(2 * 15 / 16 * 407_080)
    assert bytes_per_round(mlp, 16, "mean")["mean_per_rank"] == pytest.approx(2 * 15 / 16 * 407_080)


def test_mean_path_matches_torchft_diloco():
    """torchft's own DiLoCo (torchft/local_sgd.py) on N threads, its Manager replaced by a mock whose
    allreduce sums over the threads then divides by N (what Manager.allreduce does for ReduceOp.AVG), against
    the simulator's ``combine="mean"`` with the same outer optimizer. Runs only where torchft is installed."""
    pytest.importorskip("torchft")
    from unittest.mock import create_autospec

    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.work import _DummyWork

    n, h, rounds = 3, 4, 3
    torch.manual_seed(1)
    template = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    init = {k: v.clone() for k, v in template.state_dict().items()}
    data = [[(torch.randn(4, 5), torch.randint(0, 3, (4,))) for _ in range(h * rounds)] for _ in range(n)]

    def model_fn() -> nn.Module:
        m = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
        m.load_state_dict(init)
        return m

    adamw = lambda params: torch.optim.AdamW(params, lr=0.02)  # noqa: E731
    nesterov = lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)  # noqa: E731
    ours = simulate_diloco(model_fn, [lambda s, w=w: data[w][s] for w in range(n)], sync_every=h,
                           combine="mean", inner_optimizer_fn=adamw, outer_optimizer_fn=nesterov,
                           rounds=rounds)["model"]  # fmt: skip

    barrier, slots, results = threading.Barrier(n), [None] * n, [None] * n

    def replica(w: int) -> None:
        manager = create_autospec(Manager)
        manager._use_async_quorum = False
        manager.errored.return_value = None
        manager.should_commit.return_value = True
        manager.current_step.return_value = 0

        def allreduce(tensor: torch.Tensor, should_quantize: bool = False, **_: object):
            slots[w] = tensor.clone()
            barrier.wait()
            total = sum(slots[1:], slots[0].clone())  # SUM, then / participants: ReduceOp.AVG
            barrier.wait()
            tensor.copy_(total / n)
            return _DummyWork(tensor)

        manager.allreduce.side_effect = allreduce
        model = model_fn()
        inner, outer = adamw(list(model.parameters())), nesterov(list(model.parameters()))
        with DiLoCo(manager, [model], inner, outer, sync_every=h):
            for x, y in data[w]:
                inner.zero_grad()
                F.cross_entropy(model(x), y).backward()
                inner.step()
        results[w] = model

    threads = [threading.Thread(target=replica, args=(w,)) for w in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for theirs in results:
        for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
