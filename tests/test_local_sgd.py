"""Local SGD / DiLoCo (``sync_every``, ``combine``, ``outer_optimizer``): the rules and their refusals, and
the window arithmetic at world size 1. The multi-rank runs are cases of the forms' launches
(``tests/test_forms.py``: the three forms agree, and equal the algorithm written out in one process)."""

from __future__ import annotations

import functools
import importlib
import threading

import pytest
import torch
import torch.distributed as dist

from adasum_lightning import AdasumOptimizer
from adasum_lightning.errors import AdasumConfigurationError
from adasum_lightning.horovod.support import (
    check_no_local_sgd,
)
from adasum_lightning.local_sgd import (
    PeriodicSync,
    check_outer_optimizer,
    check_outer_optimizer_form,
    check_sync_every,
    local_sgd_without_outer_message,
)
from adasum_lightning.step import check_wire_compression
from tests.workers.lightning import PACKAGE, DDPAdasumStrategy, HorovodAdasumStrategy, adasum_strategies

#: This project's Fabric strategies for the Lightning package under test.
FABRIC = "adasum_lightning.fabric" if PACKAGE == "pytorch_lightning" else "adasum_lightning.lightning.fabric"


@pytest.mark.parametrize(
    ("sync_every", "combine", "overlap", "message"),
    [
        (
            0,
            "adasum",
            False,
            "sync_every is the number of local optimizer steps between syncs, a whole number ≥ 1",
        ),
        (2.5, "adasum", False, "a whole number ≥ 1 (1: combine every step), got 2.5"),
        (True, "adasum", False, "got True"),
        (
            4,
            "sum",
            False,
            "combine is 'adasum' (orthogonal pseudo-gradients add, parallel ones average) or 'mean'",
        ),
        (4, "adasum", True, "during backward, which sync_every=4 does not: pass overlap_backward=False"),
        (1, "mean", True, "which combine='mean' does not: pass overlap_backward=False with local SGD"),
    ],
)
def test_sync_every_rule_names_the_accepted_values(sync_every, combine, overlap, message):
    with pytest.raises(AdasumConfigurationError, match="^ddp_adasum") as info:
        check_sync_every(sync_every, combine, "ddp_adasum", overlap)
    assert message in str(info.value)
    check_sync_every(1, "adasum", "ddp_adasum", True)  # every step by Adasum may overlap backward
    with pytest.raises(AdasumConfigurationError, match="which an outer optimizer does not"):
        check_sync_every(1, "adasum", "ddp_adasum", True, outer_optimizer=True)


def test_overlap_sync_is_refused_without_windows_or_with_overlap_backward_naming_the_fix():
    check_sync_every(2, "mean", "ddp_adasum", overlap_sync=True)
    with pytest.raises(AdasumConfigurationError) as info:
        check_sync_every(1, "adasum", "ddp_adasum", overlap_sync=True)
    assert str(info.value) == (
        "ddp_adasum: overlap_sync=True runs a window's exchange during the next window, which sync_every=1 "
        "does not have: pass sync_every > 1, or overlap_sync=False."
    )
    with pytest.raises(AdasumConfigurationError) as info:
        check_sync_every(1, "adasum", "ddp_adasum", overlap_backward=True, overlap_sync=True)
    assert str(info.value) == (
        "ddp_adasum: overlap_sync=True and overlap_backward=True overlap different exchanges; pass one of "
        "them (overlap_sync with sync_every > 1, overlap_backward with sync_every=1)."
    )
    # each owner refuses when built, before the first step
    with pytest.raises(AdasumConfigurationError, match="^ddp_adasum: overlap_sync=True and overlap_backward"):
        DDPAdasumStrategy(sync_every=4, overlap_backward=True, overlap_sync=True)
    with pytest.raises(AdasumConfigurationError, match="^ddp_adasum: .* pass sync_every > 1"):
        importlib.import_module(FABRIC).DDPAdasumStrategy(overlap_sync=True)
    with pytest.raises(AdasumConfigurationError, match="^AdasumOptimizer: .* pass sync_every > 1"):
        AdasumOptimizer(torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1), overlap_sync=True)


def test_overlap_sync_raises_the_exchanges_error_at_the_next_window_end_and_joins_its_thread():
    # world size 1; the exchange of the window that ends at step 2 fails in the worker thread
    param = torch.nn.Parameter(torch.zeros(2))
    periodic = PeriodicSync([param], sync_every=2, combine="mean", overlap_sync=True)

    def lost_peer(*args) -> None:
        raise RuntimeError("peer lost")

    periodic._combine = lost_peer

    def local_step() -> None:
        param.data.add_(1.0)

    for _ in range(3):
        periodic.step(local_step)
    assert param.tolist() == [3.0, 3.0]  # the failure is not seen before its window's result is needed
    with pytest.raises(RuntimeError, match="peer lost"):
        periodic.step(local_step)
    assert [t for t in threading.enumerate() if t.name.startswith("adasum-overlap-sync")]
    periodic.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("adasum-overlap-sync")]


def test_outer_optimizer_rule_counts_the_parameters_that_differ_and_names_the_owners_form():
    check_outer_optimizer("x", [1, 2, 3], [3, 2, 1], builder=False)
    with pytest.raises(AdasumConfigurationError) as info:
        check_outer_optimizer("AdasumOptimizer", [1, 2, 3], [1, 4], builder=False)
    assert str(info.value) == (
        "AdasumOptimizer: the outer optimizer must step the same parameters as the inner one (2 of the inner "
        "optimizer's parameters missing, 1 others): pass an optimizer over the same parameters, e.g. "
        "torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)."
    )
    with pytest.raises(AdasumConfigurationError) as info:
        check_outer_optimizer("ddp_adasum", [1, 2], [3], builder=True)
    assert str(info.value).endswith(
        "pass a callable such as functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, nesterov=True), "
        "which builds it from them."
    )


def test_outer_optimizer_form_rule_shows_the_form_each_owner_takes():
    model = torch.nn.Linear(3, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    check_outer_optimizer_form("ddp_adasum", functools.partial(torch.optim.SGD, lr=0.1), builder=True)
    check_outer_optimizer_form("AdasumOptimizer", sgd, builder=False)
    check_outer_optimizer_form("ddp_adasum", None, builder=True)
    with pytest.raises(AdasumConfigurationError) as info:
        check_outer_optimizer_form("ddp_adasum", sgd, builder=True)
    assert str(info.value) == (
        "ddp_adasum's outer_optimizer builds the outer optimizer from an optimizer's parameters (one per "
        "optimizer, at its first step): pass a callable such as functools.partial(torch.optim.SGD, lr=0.1, "
        "momentum=0.9, nesterov=True), got SGD"
    )
    with pytest.raises(AdasumConfigurationError, match=r"got str$"):
        check_outer_optimizer_form("ddp_adasum", "SGD", builder=True)
    with pytest.raises(
        AdasumConfigurationError, match=r"^AdasumOptimizer's outer_optimizer is an optimizer over"
    ):
        check_outer_optimizer_form(
            "AdasumOptimizer", functools.partial(torch.optim.SGD, lr=0.1), builder=False
        )


def test_an_optimizer_class_as_outer_optimizer_is_refused_naming_the_learning_rate():
    # SGD's own default lr (0.001) would be the outer learning rate, silently
    with pytest.raises(AdasumConfigurationError) as info:
        DDPAdasumStrategy(sync_every=10, outer_optimizer=torch.optim.SGD)
    assert str(info.value) == (
        "ddp_adasum's outer_optimizer is the class SGD, which would step with its default learning rate: "
        "pass a callable such as functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, nesterov=True), "
        "the outer learning rate named"
    )
    with pytest.raises(
        AdasumConfigurationError, match=r"^AdasumOptimizer's outer_optimizer is the class Adam, "
    ):
        check_outer_optimizer_form("AdasumOptimizer", torch.optim.Adam, builder=False)


def test_sync_every_accepts_any_integer_type():
    import numpy as np

    check_sync_every(np.int64(5), "adasum", "ddp_adasum")
    assert DDPAdasumStrategy(sync_every=np.int64(5)).sync_every == 5


def test_horovod_strategies_refuse_local_sgd_options_naming_ddp_adasum():
    with pytest.raises(AdasumConfigurationError) as info:
        HorovodAdasumStrategy(sync_every=4, combine="mean")
    assert str(info.value) == (
        "horovod_adasum has no combine, sync_every: Horovod's optimizer reduces inside every backward pass. "
        "Local SGD / DiLoCo is ddp_adasum's: DDPAdasumStrategy(sync_every=..., combine=..., "
        "outer_optimizer=...), launched by Lightning, torchrun or SLURM."
    )
    check_no_local_sgd(["lr_scaling"], "horovod")


def test_strategies_refuse_local_sgd_settings_when_built():
    with pytest.raises(AdasumConfigurationError, match="sync_every is the number"):
        DDPAdasumStrategy(sync_every=0)
    with pytest.raises(AdasumConfigurationError, match="pass overlap_backward=False with local SGD"):
        DDPAdasumStrategy(overlap_backward=True, sync_every=10)
    fabric = importlib.import_module(FABRIC)
    with pytest.raises(AdasumConfigurationError, match="combine is 'adasum'"):
        fabric.DDPAdasumStrategy(combine="median")
    model = torch.nn.Linear(3, 2)
    with pytest.raises(AdasumConfigurationError, match="pass a callable such as functools.partial"):
        fabric.DDPAdasumStrategy(sync_every=4, outer_optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_compression_rule_names_the_accepted_values_and_every_owner_applies_it(one_process_group):
    assert check_wire_compression(None, "ddp_adasum") is None
    assert check_wire_compression("bf16", "ddp_adasum") == torch.bfloat16
    assert check_wire_compression("fp16", "ddp_adasum") == torch.float16
    with pytest.raises(AdasumConfigurationError) as info:
        check_wire_compression("none", "ddp_adasum")  # Horovod's spelling of off
    assert str(info.value) == (
        "ddp_adasum's compression is None (off), 'bf16' or 'fp16' (every piece the combination sends rounded "
        "to bfloat16 or float16), got 'none'"
    )
    fabric = importlib.import_module(FABRIC)
    owners = [DDPAdasumStrategy, adasum_strategies.FSDPAdasumStrategy, fabric.DDPAdasumStrategy,
              fabric.FSDPAdasumStrategy]  # fmt: skip
    for owner in owners:
        assert owner(compression="bf16").wire_dtype == torch.bfloat16
        refused = r"^\w+_adasum's compression is None .*got 'int8'$"
        with pytest.raises(AdasumConfigurationError, match=refused):
            owner(compression="int8")
    sgd = torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1)
    with pytest.raises(AdasumConfigurationError, match="^AdasumOptimizer's compression is None"):
        AdasumOptimizer(sgd, compression="float16")


@pytest.fixture
def one_process_group(tmp_path):
    """A default process group of this process alone (one an earlier test of this worker left is reused)."""
    if dist.is_initialized():
        assert dist.get_world_size() == 1
        yield
        return
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_adasum_optimizer_refuses_an_outer_optimizer_over_other_parameters(one_process_group):
    model, other = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    with pytest.raises(AdasumConfigurationError, match=r"\(0 of the inner optimizer's parameters missing, 2"):
        AdasumOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            sync_every=4,
            outer_optimizer=torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.7),
        )


def _train(optimizer_for, steps: int) -> tuple[torch.nn.Linear, object]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = optimizer_for(model)
    x = torch.randn(steps, 5, 3)
    for k in range(steps):
        model(x[k]).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def test_adasum_optimizer_warns_that_adasum_of_windows_without_an_outer_optimizer_overshoots(
    one_process_group,
):
    model = torch.nn.Linear(3, 2)
    with pytest.warns(UserWarning) as warned:
        AdasumOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), sync_every=10)
    assert [str(w.message) for w in warned] == [local_sgd_without_outer_message("AdasumOptimizer", 10)]
    assert "pass an outer optimizer with a small learning rate" in str(warned[0].message)


def test_a_window_at_world_size_one_is_an_outer_step_on_the_summed_local_updates(one_process_group):
    # H = 3 inner SGD steps, then the outer SGD (no momentum, lr 0.5) steps θ_sync by 0.5 × (θ_local − θ_sync)
    def adasum(model):
        outer = torch.optim.SGD(model.parameters(), lr=0.5)
        return AdasumOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), sync_every=3, outer_optimizer=outer
        )

    model, optimizer = _train(adasum, 3)
    plain, _ = _train(lambda m: torch.optim.SGD(m.parameters(), lr=0.1), 3)
    torch.manual_seed(0)
    start = torch.nn.Linear(3, 2)
    for p, local, p0 in zip(model.parameters(), plain.parameters(), start.parameters(), strict=True):
        assert torch.allclose(p, p0 + 0.5 * (local - p0), atol=1e-7)
        assert p.grad is None  # the outer step's gradient is not left behind
    state = optimizer.state_dict()["adasum_sync"]
    assert state["steps"] == 0 and len(state["synced"]) == 2


def test_window_position_and_outer_state_resume_exactly(one_process_group):
    # 5 steps with H = 3 (mid-window), saved, loaded into fresh objects, 4 more: equal to 9 steps at once
    def make(model):
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return AdasumOptimizer(inner, sync_every=3, outer_optimizer=outer, combine="mean")

    straight, _ = _train(make, 9)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = make(model)
    x = torch.randn(9, 5, 3)
    for k in range(9):
        if k == 5:
            saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            assert saved["optimizer"]["adasum_sync"]["steps"] == 2
            model = torch.nn.Linear(3, 2)
            model.load_state_dict(saved["model"])
            optimizer = make(model)
            optimizer.load_state_dict(saved["optimizer"])
        model(x[k]).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    for a, b in zip(straight.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_overlap_sync_state_dict_ends_the_window_and_the_exchange_in_flight_first(one_process_group):
    # 5 steps, H = 2: the exchange of the window ended at step 4 is in flight, one step since. At world size 1
    # the mean of the pseudo-gradients is this rank's own, so the flushed parameters are plain SGD's.
    def overlapped(model):
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        return AdasumOptimizer(inner, sync_every=2, combine="mean", overlap_sync=True)

    model, optimizer = _train(overlapped, 5)
    state = optimizer.state_dict()["adasum_sync"]
    plain, _ = _train(lambda m: torch.optim.SGD(m.parameters(), lr=0.1), 5)
    assert state["steps"] == 0
    for p, saved, local in zip(model.parameters(), state["synced"], plain.parameters(), strict=True):
        assert torch.equal(p, saved) and torch.allclose(p, local, atol=1e-6)
    assert not [t for t in threading.enumerate() if t.name.startswith("adasum-overlap-sync")]


def test_periodic_sync_every_step_is_the_adasum_step_itself():
    periodic = PeriodicSync([torch.zeros(2)], sync_every=1)
    assert periodic.every_step and periodic.state_dict()["synced"] is None
    assert not PeriodicSync([torch.zeros(2)], sync_every=1, combine="mean").every_step
    partial = functools.partial(torch.optim.SGD, lr=0.7)
    assert not PeriodicSync(
        [p := torch.nn.Parameter(torch.zeros(2))], outer_optimizer=partial([p])
    ).every_step


def test_the_setup_line_names_the_wire_and_the_overlap():
    every_step = DDPAdasumStrategy(compression="bf16", process_group_backend="gloo")
    assert every_step._describe_reduction() == "Adasum of parameter deltas over gloo, sent as bf16"
    windows = DDPAdasumStrategy(
        sync_every=10, combine="mean", compression="fp16", overlap_sync=True, process_group_backend="gloo"
    )
    assert windows._describe_reduction() == (
        "local SGD over gloo: every 10 steps the mean of the pseudo-gradients, sent as fp16, exchanged "
        "behind the next window's steps, no outer optimizer"
    )
