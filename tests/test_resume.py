"""Resume: exact at the same world size, mapped at another one, across strategies; ``lr_find`` + ``horovod``.

Each rank keeps its own optimizer state under Adasum, so every rank's state is saved with the checkpoint
(rank 0's inside it, rank r's beside it in ``<file>.rank<r>-optimizer.pt``) and restored on its own rank. Real
processes (``tests/workers/fit.py``: Lightning's launcher for ``ddp_adasum``/``ddp``, ``horovodrun`` for the
Horovod strategies) run as cases of a few launches (``tests/cases.py``); every rank checked.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from adasum_lightning.checkpoint import (
    PERIODIC_SYNC_STATES,
    RANK_OPTIMIZER_STATES,
    SAVE_IDENTITY,
    rank_optimizer_path,
)
from adasum_lightning.learning_rate import scaled_learning_rate_message
from tests.cases import Launch, case
from tests.helpers import assert_ranks_identical

pytestmark = pytest.mark.mpi

STEPS_PER_EPOCH = {1: 16, 2: 8, 4: 4}  # 64 samples, batch 4, a DistributedSampler shard per rank


def launch(strategy: str, np: int, phase: int = 0) -> Launch:
    return Launch("lightning" if strategy in ("ddp_adasum", "ddp") else "horovodrun", np, phase)


def fit(name: str, strategy: str, np: int, *args: str, phase: int = 0):
    return case(launch(strategy, np, phase), name, "fit", "--strategy", strategy, *args)


def checkpoint_of(out: Path) -> Path:
    (path,) = out.rglob("*.ckpt")  # ModelCheckpoint keeps the last epoch's only
    return path


def assert_same_state(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for key, state in a.items():
        for name, tensor in state.items():
            assert torch.equal(tensor, b[key][name]), (what, key, name)


# ---------------------------------------------------------------- same world size: whole = first + resumed
def stop_and_resume(strategy: str, optimizer: str, *extra: str):
    lr = "0.05" if optimizer == "sgd" else "0.01"
    options = ("--optimizer", optimizer, "--lr", lr, "--momentum", "0.9", *extra)
    name = f"resume-{strategy}-{optimizer}" + "".join(extra).replace("--", "-")
    return (
        fit(f"{name}-whole", strategy, 2, "--epochs", "2", *options),
        fit(f"{name}-first", strategy, 2, "--epochs", "1", *options),
        fit(f"{name}-resumed", strategy, 2, "--epochs", "2", "--ckpt-path", f"{{{name}-first}}", *options),
    )


COMPAT = ("ddp_adasum", "sgd")  # the case make test-compat runs against the other Lightning releases
STOP_AND_RESUME = {
    (s, o): stop_and_resume(s, o)
    for s, o in [("ddp_adasum", "sgd"), ("ddp_adasum", "adam"), ("horovod_adasum", "sgd"), ("horovod", "sgd")]
}
# local SGD with an outer Nesterov SGD, 3 steps a window: the epoch's checkpoint (step 8) ends a window early
LOCAL_SGD = ("--sync-every", "3", "--outer-lr", "0.5")
STOP_AND_RESUME["ddp_adasum", "sgd-local-sgd"] = stop_and_resume("ddp_adasum", "sgd", *LOCAL_SGD)
# overlap_sync: the exchange of the window ended at step 6 is in flight at the checkpoint, finished first
STOP_AND_RESUME["ddp_adasum", "sgd-local-sgd-overlap"] = stop_and_resume(
    "ddp_adasum", "sgd", *LOCAL_SGD, "--overlap-sync"
)


@pytest.mark.parametrize(
    "strategy, optimizer",
    [
        pytest.param(s, o, marks=[pytest.mark.cases(*cs), *[pytest.mark.compat] * ((s, o) == COMPAT)])
        for (s, o), cs in STOP_AND_RESUME.items()
    ],
)  # fmt: skip
def test_stop_and_resume_at_an_epoch_boundary_equals_an_uninterrupted_run(strategy, optimizer, cases):
    whole, first, resumed = (cases[c] for c in STOP_AND_RESUME[strategy, optimizer])
    ckpt = checkpoint_of(first.out)
    if "local-sgd" in optimizer:  # the window's position and the outer momentum, saved and restored
        (state,) = torch.load(ckpt, weights_only=False)[PERIODIC_SYNC_STATES]
        assert state["steps"] == 0 and state["synced"] is None
        assert state["outer_optimizer"]["state"][0]["momentum_buffer"].abs().sum() > 0
    assert Path(rank_optimizer_path(ckpt, 1)).is_file()
    assert torch.load(ckpt, weights_only=False)[RANK_OPTIMIZER_STATES]["world_size"] == 2
    for r in range(2):
        assert resumed.ranks[r]["global_step_start"] == 8
        assert resumed.ranks[r]["global_step"] == whole.ranks[r]["global_step"] == 16
        # every rank resumed from its own optimizer state (they differ: each rank's own gradients)
        assert_same_state(resumed.ranks[r]["start_opt_state"], first.ranks[r]["end_opt_state"], f"rank {r}")
        for name, tensor in whole.ranks[r]["end"].items():
            assert torch.equal(resumed.ranks[r]["end"][name], tensor), (strategy, r, name)
    if strategy != "horovod":  # averaging gives every rank the same state; Adasum does not
        with pytest.raises(AssertionError):
            assert_same_state(first.ranks[0]["end_opt_state"], first.ranks[1]["end_opt_state"], "own states")
    # ModelCheckpoint kept only the last epoch: the removed checkpoint took its rank file with it
    assert sorted(p.name for p in checkpoint_of(whole.out).parent.iterdir()) == [
        "epoch=1-step=16.ckpt",
        "epoch=1-step=16.ckpt.rank1-optimizer.pt",
    ]


# ---------------------------------------------------------------- another world size
def saved(strategy: str, np: int):
    """One epoch at lr 0.05 on ``np`` ranks: the checkpoint the resumes below start from."""
    return fit(f"saved-{strategy}-{np}", strategy, np, "--epochs", "1", "--lr", "0.05")


def resumed(strategy: str, np: int, source, name: str | None = None, *args: str):
    """Two epochs in all at lr 0.05 on ``np`` ranks from ``source``'s checkpoint, in a later launch."""
    name = name or f"resumed-{strategy}-{np}-from-{source.name}"
    return fit(name, strategy, np, "--epochs", "2", "--ckpt-path", f"{{{source.name}}}", "--lr", "0.05",
               *args, phase=1)  # fmt: skip


WORLD_SIZES = [
    (s, old, new)
    for s in ("ddp_adasum", "horovod_adasum", "horovod")
    for old, new in ((2, 4), (4, 2), (2, 1))
    if s == "ddp_adasum" or (old, new) != (2, 1)  # one process under horovodrun: the 2 → 1 of ddp_adasum
]
ANOTHER_WORLD_SIZE = {
    (s, old, new): (saved(s, old), resumed(s, new, saved(s, old))) for s, old, new in WORLD_SIZES
}


@pytest.mark.parametrize(
    "strategy, old, new",
    [pytest.param(*k, marks=pytest.mark.cases(*cs)) for k, cs in ANOTHER_WORLD_SIZE.items()],
)
def test_resume_at_another_world_size_maps_old_ranks_to_new(strategy, old, new, cases):
    before, after = (cases[c] for c in ANOTHER_WORLD_SIZE[strategy, old, new])
    assert_ranks_identical(after.ranks)
    factor = new if strategy == "horovod" else 1  # lr_scaling="auto" at the new world size
    for r, res in enumerate(after.ranks):
        assert res["world_size"] == new and res["global_step_start"] == STEPS_PER_EPOCH[old]
        assert res["global_step"] == STEPS_PER_EPOCH[old] + STEPS_PER_EPOCH[new]
        assert_same_state(res["start_opt_state"], before.ranks[r % old]["end_opt_state"], f"new rank {r}")
        assert res["lrs"][0] == pytest.approx(0.05 * factor)


# ---------------------------------------------------------------- across strategies
DDP_TO_ADASUM = (saved("ddp", 2), resumed("ddp_adasum", 2, saved("ddp", 2)))
HOROVOD_TO_DDP = (saved("horovod_adasum", 2), resumed("ddp_adasum", 2, saved("horovod_adasum", 2)))


@pytest.mark.cases(*DDP_TO_ADASUM)
def test_a_ddp_checkpoint_resumes_under_ddp_adasum_from_rank_zeros_state(cases):
    before, after = (cases[c] for c in DDP_TO_ADASUM)
    assert RANK_OPTIMIZER_STATES not in torch.load(checkpoint_of(before.out), weights_only=False)
    assert_ranks_identical(after.ranks)
    for res in after.ranks:  # under ddp every rank's state was the same; the checkpoint holds it
        assert res["global_step_start"] == 8 and res["global_step"] == 16
        assert_same_state(res["start_opt_state"], before.ranks[0]["end_opt_state"], "ddp state")


@pytest.mark.cases(*HOROVOD_TO_DDP)
def test_a_horovod_adasum_checkpoint_resumes_under_ddp_adasum_with_each_ranks_state(cases):
    before, after = (cases[c] for c in HOROVOD_TO_DDP)
    assert_ranks_identical(after.ranks)
    for r, res in enumerate(after.ranks):
        assert_same_state(res["start_opt_state"], before.ranks[r]["end_opt_state"], f"rank {r}")


# ---------------------------------------------------------------- a lost, damaged or mismatched rank file
LOST = fit("lost-rank-file-saved", "ddp_adasum", 2, "--epochs", "1", "--lr", "0.05")
AFTER_SAVE = Launch("lightning", 2, phase=1)


def damaged(name: str, source, *how: str):
    """A copy of ``source``'s checkpoint with a companion file damaged
    (``tests/workers/damage_checkpoint.py``), then a resume from it."""
    copy = case(AFTER_SAVE, f"{name}-copy", "damage_checkpoint", f"{{{source.name}}}", *how)
    return copy, resumed("ddp_adasum", 2, copy, f"{name}-resumed")


MISSING_RANK_FILE = (LOST, *damaged("lost-rank-file", LOST, "drop", "1"))


@pytest.mark.cases(*MISSING_RANK_FILE)
def test_a_missing_rank_file_resumes_that_rank_from_rank_zeros_state_with_a_warning(cases):
    before, dropped, after = (cases[c] for c in MISSING_RANK_FILE)
    ckpt = checkpoint_of(dropped.out)
    assert [s["status"] for s in dropped.statuses] == ["ok", "ok"]
    assert not Path(rank_optimizer_path(ckpt, 1)).exists()
    assert f"[rank 1] {rank_optimizer_path(ckpt, 1)} is missing" in after.case_output
    assert_same_state(
        after.ranks[1]["start_opt_state"], before.ranks[0]["end_opt_state"], "rank 0's on rank 1"
    )
    assert_ranks_identical(after.ranks)


SAVED_2 = saved("ddp_adasum", 2)  # step 8
WHOLE = STOP_AND_RESUME["ddp_adasum", "sgd"][0]  # another run, saved at step 16
OTHER_SAVE = (SAVED_2, WHOLE, *damaged("other-save", SAVED_2, "other-save", f"{{{WHOLE.name}}}"))
TRUNCATED = (SAVED_2, *damaged("truncated-rank-file", SAVED_2, "truncate", "1"))


@pytest.mark.cases(*OTHER_SAVE)
def test_a_rank_file_of_another_save_is_refused_on_every_rank_naming_both_files(cases):
    copy, after = cases[OTHER_SAVE[2]], cases[OTHER_SAVE[3]]
    ckpt = os.path.realpath(checkpoint_of(copy.out))
    rank_file = rank_optimizer_path(ckpt, 1)
    ours = torch.load(ckpt, weights_only=False)[SAVE_IDENTITY]
    theirs = torch.load(rank_file, weights_only=False)[SAVE_IDENTITY]
    assert (ours["global_step"], theirs["global_step"]) == (8, 16)
    expected = (
        f"rank 1: {rank_file} (step 16, save {theirs['save_id'][:8]}) is from another save than checkpoint "
        f"{ckpt} (step 8, save {ours['save_id'][:8]}): a save was interrupted between the files, or they "
        "were copied from different saves. Resume from another checkpoint, or delete it to resume rank 1 "
        "from rank 0's optimizer state, or pass ckpt_path=None to start from scratch."
    )
    assert after.errors() == [("IncompleteCheckpointError", expected)] * 2
    assert not list(after.out.glob("rank*.pt"))  # no rank trained


CUT_SHORT = {
    when: damaged(f"cut-{when}", SAVED_2, f"cut-{when}-checkpoint", f"{{{WHOLE.name}}}")
    for when in ("before", "after")
}


@pytest.mark.parametrize(
    "when", [pytest.param(w, marks=pytest.mark.cases(SAVED_2, WHOLE, *cs)) for w, cs in CUT_SHORT.items()]
)
def test_a_save_cut_short_resumes_every_rank_from_the_checkpoints_own_save(when, cases):
    before, (copy, after) = cases[SAVED_2], (cases[c] for c in CUT_SHORT[when])
    rank_file = rank_optimizer_path(os.path.realpath(checkpoint_of(copy.out)), 1)
    committed, pending = (
        torch.load(f, weights_only=False)[SAVE_IDENTITY] for f in (rank_file, f"{rank_file}.next")
    )
    # before rank 0 wrote the checkpoint, the pending file is the cut save's (step 16 here); after, it is
    # the checkpoint's own and the committed file the save's before (step 16 here)
    assert (committed["global_step"], pending["global_step"]) == ((8, 16) if when == "before" else (16, 8))
    assert_ranks_identical(after.ranks)
    for r, res in enumerate(after.ranks):
        assert res["global_step_start"] == 8 and res["global_step"] == 16
        assert_same_state(res["start_opt_state"], before.ranks[r]["end_opt_state"], f"rank {r}")
    assert "is missing" not in after.case_output


@pytest.mark.cases(*TRUNCATED)
def test_a_truncated_rank_file_is_named_on_every_rank(cases):
    copy, after = cases[TRUNCATED[1]], cases[TRUNCATED[2]]
    ckpt = os.path.realpath(checkpoint_of(copy.out))
    rank_file = rank_optimizer_path(ckpt, 1)
    for kind, message in after.errors():
        assert kind == "IncompleteCheckpointError"
        assert message.startswith(
            f"rank 1: {rank_file} (rank 1's optimizer state of checkpoint {ckpt}) could not be read "
            "(RuntimeError: PytorchStreamReader failed"
        ), message
        assert message.endswith(
            "it is truncated or corrupt. Resume from another checkpoint, or delete it to resume rank 1 from "
            "rank 0's optimizer state, or pass ckpt_path=None to start from scratch."
        ), message
    assert len({message for _, message in after.errors()}) == 1  # the same on both ranks
    assert not list(after.out.glob("rank*.pt"))


# ---------------------------------------------------------------- lr_find
LR_FIND = fit("lr-find-horovod", "horovod", 2, "--epochs", "1", "--lr-find", "--samples", "256")


@pytest.mark.cases(LR_FIND)
def test_horovod_after_lr_find_warns_that_it_multiplied_the_learning_rate(cases):
    result = cases[LR_FIND]
    suggestion = result.ranks[0]["lr_find_suggestion"]
    assert suggestion is not None and all(res["lr_find_suggestion"] == suggestion for res in result.ranks)
    for res in result.ranks:
        assert res["start_lr"] == pytest.approx(2 * suggestion)  # what the warning says
    assert scaled_learning_rate_message("horovod", 2.0) in result.case_output
