"""The in-process simulator (benchmarks/simulate.py): arithmetic, errors, and a match with real Horovod."""

import pytest
import torch
import torch.nn.functional as F

from adasum_lightning.reference import adasum
from benchmarks.simulate import simulate, steps_per_epoch
from tests.cases import Launch, case
from tests.workers.lightning import pl
from tests.workers.sim_match import BATCH, LR, SimNet, teacher_data  # noqa: E402

# Measured difference between simulated and real parameters after 300 steps (torch 2.14.1, Horovod 0.28.1,
# Open MPI 4.1.4): 0 (bitwise equal) for Adasum at 2 and 4 ranks (and for averaging at 4 ranks, checked by
# `make bench`, docs/benchmarks.md). The tolerance leaves room for another MPI reduction order or BLAS:
# 1e-5 of the largest parameter magnitude.
REL_TOL = 1e-5


def _fresh(seed: int = 7, total_steps: int = 300) -> SimNet:
    pl.seed_everything(seed, verbose=False)
    return SimNet(total_steps=total_steps)


def _local_delta(start: dict, batch, lr: float) -> dict:
    net = _fresh()
    net.load_state_dict(start)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    x, y = batch
    F.cross_entropy(net(x), y).backward()
    opt.step()
    return {k: v.detach() - start[k] for k, v in net.state_dict().items()}


def test_one_adasum_step_combines_the_workers_local_deltas():
    data = teacher_data()
    module = _fresh()
    start = {k: v.clone() for k, v in module.state_dict().items()}
    first_lr = torch.optim.lr_scheduler.OneCycleLR(
        torch.optim.SGD([torch.zeros(1)], lr=LR), max_lr=LR, total_steps=300, anneal_strategy="linear"
    ).get_last_lr()[0]
    simulate(module, data, num_workers=2, batch_size=BATCH, max_steps=1, sampler_seed=3, progress=False)
    sampler = [torch.utils.data.DistributedSampler(data, num_replicas=2, rank=r, seed=3) for r in range(2)]
    batches = []
    for s in sampler:
        s.set_epoch(0)
        idx = list(s)[:BATCH]
        batches.append((data.tensors[0][idx], data.tensors[1][idx]))
    deltas = [_local_delta(start, b, first_lr) for b in batches]
    for name, value in module.state_dict().items():
        expected = start[name] + adasum(deltas[0][name], deltas[1][name])
        assert torch.allclose(value, expected, rtol=1e-6, atol=1e-8), name
        assert not torch.allclose(value, start[name] + deltas[0][name] + deltas[1][name], atol=1e-8)


def test_one_worker_is_plain_training_and_average_scales_the_lr():
    data = teacher_data()
    plain = _fresh()
    config = plain.configure_optimizers()
    opt, sched = config["optimizer"], config["lr_scheduler"]["scheduler"]
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False)
    for i, (x, y) in enumerate(loader):
        if i == 20:
            break
        opt.zero_grad()
        F.cross_entropy(plain(x), y).backward()
        opt.step()
        sched.step()
    for method in ("adasum", "average"):
        sim = _fresh()
        result = simulate(
            sim,
            data,
            num_workers=1,
            batch_size=BATCH,
            method=method,
            max_steps=20,
            shuffle=False,
            progress=False,
        )
        assert result.lr_factor == 1.0 and result.history[-1]["step"] == 20
        for name, value in sim.state_dict().items():
            assert torch.equal(value, plain.state_dict()[name]), (method, name)


def test_one_average_step_uses_the_mean_gradient_and_lr_times_n():
    data = teacher_data()
    module = _fresh()
    start = {k: v.clone() for k, v in module.state_dict().items()}
    result = simulate(module, data, num_workers=4, batch_size=BATCH, method="average", max_steps=1,
                      sampler_seed=5, progress=False)  # fmt: skip
    assert result.lr_factor == 4.0
    net = _fresh()
    net.load_state_dict(start)
    grads = []
    for rank in range(4):
        sampler = torch.utils.data.DistributedSampler(data, num_replicas=4, rank=rank, seed=5)
        idx = list(sampler)[:BATCH]
        net.zero_grad()
        F.cross_entropy(net(data.tensors[0][idx]), data.tensors[1][idx]).backward()
        grads.append({n: p.grad.clone() for n, p in net.named_parameters()})
    config = net.configure_optimizers()
    lr = 4 * config["lr_scheduler"]["scheduler"].get_last_lr()[0]  # the first step's lr, × N
    for name, value in module.state_dict().items():
        mean_grad = sum(g[name] for g in grads) / 4
        expected = start[name] - lr * mean_grad  # SGD's first step: the momentum buffer is the gradient
        assert torch.allclose(value, expected, rtol=1e-5, atol=1e-7), name


def test_history_target_and_errors():
    data = teacher_data()
    result = simulate(
        _fresh(total_steps=2 * 64),
        data,
        num_workers=2,
        batch_size=BATCH,
        max_epochs=2,
        val_dataset=data,
        target=0.0,
        progress=False,
    )
    assert result.steps_per_epoch == steps_per_epoch(1024, 2, BATCH) == 64
    assert (result.epochs_to_target, result.steps_to_target) == (1, 64)  # stops once the target is reached
    assert len(result.history) == 1 and 0.0 <= result.history[0]["val_acc"] <= 1.0
    assert steps_per_epoch(60_000, 64, 32) == 30  # 937.5 → 938 padded samples per rank
    with pytest.raises(ValueError, match="power-of-2"):
        simulate(_fresh(), data, num_workers=3, batch_size=BATCH, progress=False)
    with pytest.raises(ValueError, match="method"):
        simulate(_fresh(), data, num_workers=2, batch_size=BATCH, method="sum", progress=False)


def test_a_world_schedule_resumes_each_rank_from_rank_r_mod_w():
    data = teacher_data()
    fixed, listed = _fresh(total_steps=128), _fresh(total_steps=128)
    simulate(fixed, data, num_workers=2, batch_size=BATCH, max_epochs=2, progress=False)
    simulate(listed, data, num_workers=[2, 2], batch_size=BATCH, max_epochs=2, progress=False)
    for name, value in fixed.state_dict().items():
        assert torch.equal(value, listed.state_dict()[name]), name
    # 4 → 2 → 4: 32 + 64 + 32 steps (1024 samples, batch 8 per rank); averaging keeps the first W's lr × 4.
    for method, factor in (("adasum", 1.0), ("average", 4.0)):
        result = simulate(
            _fresh(total_steps=128), data, num_workers=[4, 2, 4], batch_size=BATCH, method=method,
            max_epochs=3, val_dataset=data, progress=False,
        )  # fmt: skip
        assert [(h["num_workers"], h["step"]) for h in result.history] == [(4, 32), (2, 96), (4, 128)]
        assert (result.num_workers, result.steps_per_epoch, result.lr_factor) == (4, 32, factor)
        # The one-cycle schedule carries on across the changes (fresh schedulers would restart it): one step
        # fewer in it runs out on the last step.
        with pytest.raises(
            ValueError, match="Tried to step 128 times. The specified number of total steps is 127"
        ):
            simulate(
                _fresh(total_steps=127), data, num_workers=[4, 2, 4], batch_size=BATCH, method=method,
                max_epochs=3, progress=False,
            )  # fmt: skip
    with pytest.raises(
        ValueError, match="num_workers gives 2 world sizes for max_epochs=3: give one per epoch"
    ):
        simulate(_fresh(), data, num_workers=[4, 2], batch_size=BATCH, max_epochs=3, progress=False)
    with pytest.raises(ValueError, match="power-of-2 number of workers .* got 3"):
        simulate(_fresh(), data, num_workers=[4, 3], batch_size=BATCH, max_epochs=2, progress=False)


SIM_MATCH = {
    np: case(Launch("horovodrun", np), f"sim-match-{np}", "sim_match", "--strategy", "horovod_adasum",
             "--steps", "300", "--seed", "7")
    for np in (2, 4)
}  # fmt: skip


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("np", "strategy"),
    [pytest.param(np, "horovod_adasum", marks=pytest.mark.cases(c)) for np, c in SIM_MATCH.items()],
)
def test_simulation_matches_real_horovod_after_300_steps(np, strategy, cases):
    result = cases[SIM_MATCH[np]]
    assert [s["status"] for s in result.statuses] == ["ok"] * np
    real = torch.load(result.out / "rank0.pt", weights_only=False)
    assert real["global_step"] == 300 and real["world_size"] == np and real["sampler_seed"] == 7
    module = _fresh(seed=7)
    start = {k: v.clone() for k, v in module.state_dict().items()}
    method = "adasum" if strategy == "horovod_adasum" else "average"
    simulate(
        module,
        teacher_data(),
        num_workers=np,
        batch_size=BATCH,
        method=method,
        max_epochs=10**6,
        max_steps=300,
        sampler_seed=7,
        progress=False,
    )
    for name, value in module.state_dict().items():
        expected = real["params"][name]
        assert not torch.allclose(expected, start[name], atol=1e-3), name  # it did train
        scale = expected.abs().max().item()
        assert (value - expected).abs().max().item() <= REL_TOL * scale, (
            name,
            (value - expected).abs().max(),
        )
