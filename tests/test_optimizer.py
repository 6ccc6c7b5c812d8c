"""``AdasumOptimizer`` in one process (a process group of one): it behaves as the optimizer it wraps.

The multi-process behaviour (the Adasum of the ranks' updates) is tested in ``tests/test_forms.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from adasum_lightning import AdasumOptimizer
from tests.workers.samples import IndexedData, tiny_net


def _drop_a_default_group() -> None:
    # an in-process Lightning fit at world size 1 in an earlier test can leave its default group behind
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def group_of_one(tmp_path):
    _drop_a_default_group()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def batches(n: int = 6):
    data = IndexedData(4 * n)
    return [(data.x[i : i + 4], data.y[i : i + 4]) for i in range(0, 4 * n, 4)]


def train(wrap: bool, *, scaler_enabled: bool = False, inf_at: int = -1):
    torch.manual_seed(0)
    net = tiny_net()
    inner = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    optimizer = AdasumOptimizer(inner) if wrap else inner
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", enabled=scaler_enabled, init_scale=2.0**10)
    lrs = []
    for i, (x, y) in enumerate(batches()):
        loss = F.cross_entropy(net(x), y) * (float("inf") if i == inf_at else 1.0)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        scheduler.step()
        lrs.append(inner.param_groups[0]["lr"])
    return net, inner, lrs, scaler.get_scale()


@pytest.mark.parametrize("scaler", [False, True], ids=["no-scaler", "grad-scaler"])
def test_in_a_group_of_one_it_trains_as_the_wrapped_optimizer(group_of_one, scaler):
    inf_at = 2 if scaler else -1  # an overflowing step for the scaler to skip
    wrapped, wrapped_inner, wrapped_lrs, wrapped_scale = train(True, scaler_enabled=scaler, inf_at=inf_at)
    plain, plain_inner, plain_lrs, plain_scale = train(False, scaler_enabled=scaler, inf_at=inf_at)
    if scaler:  # the scaler skipped step 2 on both and halved its scale
        assert wrapped_scale == plain_scale == 2.0**9
    for a, b in zip(wrapped.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)
    assert wrapped_lrs == plain_lrs == [0.1, 0.05, 0.05, 0.025, 0.025, 0.0125]  # StepLR drives the wrapper
    for state_a, state_b in zip(wrapped_inner.state.values(), plain_inner.state.values(), strict=True):
        assert torch.equal(state_a["momentum_buffer"], state_b["momentum_buffer"])


def test_state_and_param_groups_are_the_wrapped_optimizers(group_of_one):
    net = tiny_net()
    inner = torch.optim.Adam(net.parameters(), lr=0.01)
    optimizer = AdasumOptimizer(inner)
    assert optimizer.param_groups is inner.param_groups and optimizer.state is inner.state
    assert repr(optimizer).startswith("AdasumOptimizer(Adam (")
    F.cross_entropy(net(batches()[0][0]), batches()[0][1]).backward()
    optimizer.step()
    saved = optimizer.state_dict()
    assert saved["state"][0]["step"].item() == 1.0 and saved == inner.state_dict()
    optimizer.zero_grad()
    assert all(p.grad is None for p in net.parameters())
    fresh_inner = torch.optim.Adam(net.parameters(), lr=0.5)
    fresh = AdasumOptimizer(fresh_inner)
    fresh.load_state_dict(saved)
    # loading replaces the wrapped optimizer's objects; the wrapper follows them
    assert fresh.param_groups is fresh_inner.param_groups and fresh.state is fresh_inner.state
    assert fresh.param_groups[0]["lr"] == 0.01
    assert torch.equal(fresh.state[net[0].weight]["exp_avg"], inner.state[net[0].weight]["exp_avg"])


def test_param_groups_added_later_step_with_their_own_settings(group_of_one):
    net = tiny_net()
    optimizer = AdasumOptimizer(torch.optim.SGD(net[0].parameters(), lr=0.1))
    optimizer.add_param_group({"params": net[2].parameters(), "lr": 0.0})
    assert len(optimizer.optimizer.param_groups) == 2 and optimizer.param_groups[1]["lr"] == 0.0
    before = [p.detach().clone() for p in net.parameters()]
    F.cross_entropy(net(batches()[0][0]), batches()[0][1]).backward()
    optimizer.step()
    after = list(net.parameters())
    assert not torch.equal(before[0], after[0]) and torch.equal(before[2], after[2])  # lr 0: unchanged


def test_lbfgs_steps_with_a_closure(group_of_one):
    torch.manual_seed(0)
    net = tiny_net()
    optimizer = AdasumOptimizer(torch.optim.LBFGS(net.parameters(), lr=0.5, max_iter=4))
    x, y = batches()[0]

    def closure():
        optimizer.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        return loss

    first = optimizer.step(closure)
    assert isinstance(first, torch.Tensor) and F.cross_entropy(net(x), y).item() < first.item()


def test_bad_input_names_the_fix(group_of_one):
    with pytest.raises(TypeError, match=r"AdasumOptimizer wraps a torch.optim.Optimizer, got list: build"):
        AdasumOptimizer([torch.zeros(2)])
    sgd = torch.optim.SGD(tiny_net().parameters(), lr=0.1)
    with pytest.raises(
        TypeError, match=r"timeout is a datetime.timedelta, e.g. timedelta\(minutes=5\); got 5"
    ):
        AdasumOptimizer(sgd, timeout=5)
    with pytest.raises(TypeError, match="already an AdasumOptimizer: wrap the torch.optim optimizer once"):
        AdasumOptimizer(AdasumOptimizer(sgd))


def test_without_a_process_group_it_names_init_process_group():
    _drop_a_default_group()
    with pytest.raises(RuntimeError, match=r"call torch.distributed.init_process_group\(\) before building"):
        AdasumOptimizer(torch.optim.SGD(tiny_net().parameters(), lr=0.1))
