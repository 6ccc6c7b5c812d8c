"""Resume: exact at the same world size, mapped at another one, across strategies; ``lr_find`` + ``horovod``.

Each rank keeps its own optimizer state under Adasum, so every rank's state is saved with the checkpoint
(rank 0's inside it, rank r's beside it in ``<file>.rank<r>-optimizer.pt``) and restored on its own rank. Real
processes (``tests/workers/fit.py``: Lightning's launcher for ``ddp_adasum``/``ddp``, ``horovodrun`` for the
Horovod strategies), every rank checked.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from adasum_lightning.trainer._base import RANK_OPTIMIZER_STATES, rank_optimizer_path
from adasum_lightning.validation import scaled_learning_rate_message
from tests.helpers import assert_ranks_identical, load_ranks, run_horovod, run_lightning

pytestmark = pytest.mark.mpi

STEPS_PER_EPOCH = {1: 16, 2: 8, 4: 4}  # 64 samples, batch 4, a DistributedSampler shard per rank


def fit(strategy: str, np: int, out: Path, *args: str) -> list[dict]:
    worker_args = [str(out), "--strategy", strategy, *args]
    if strategy in ("ddp_adasum", "ddp"):
        run_lightning(np, "fit", *worker_args, timeout=240)
    else:
        run_horovod(np, "fit", *worker_args, timeout=240)
    return load_ranks(out, np)


def resume(strategy: str, np: int, out: Path, ckpt: Path, *args: str) -> list[dict]:
    """A fit for 2 epochs in all from ``ckpt``."""
    return fit(strategy, np, out, "--epochs", "2", "--ckpt-path", str(ckpt), *args)


def checkpoint_of(out: Path) -> Path:
    (path,) = out.rglob("*.ckpt")  # ModelCheckpoint keeps the last epoch's only
    return path


def assert_same_state(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for key, state in a.items():
        for name, tensor in state.items():
            assert torch.equal(tensor, b[key][name]), (what, key, name)


@pytest.mark.parametrize(
    "strategy, optimizer",
    [
        pytest.param("ddp_adasum", "sgd", marks=pytest.mark.compat),
        ("ddp_adasum", "adam"),
        ("horovod_adasum", "sgd"),
        ("horovod", "sgd"),
    ],
)
def test_stop_and_resume_at_an_epoch_boundary_equals_an_uninterrupted_run(strategy, optimizer, tmp_path):
    lr = "0.05" if optimizer == "sgd" else "0.01"
    options = ["--optimizer", optimizer, "--lr", lr, "--momentum", "0.9"]
    whole = fit(strategy, 2, tmp_path / "whole", "--epochs", "2", *options)
    first = fit(strategy, 2, tmp_path / "first", "--epochs", "1", *options)
    ckpt = checkpoint_of(tmp_path / "first")
    assert Path(rank_optimizer_path(ckpt, 1)).is_file()
    assert torch.load(ckpt, weights_only=False)[RANK_OPTIMIZER_STATES]["world_size"] == 2
    resumed = resume(strategy, 2, tmp_path / "resumed", ckpt, *options)
    for r in range(2):
        assert resumed[r]["global_step_start"] == 8
        assert resumed[r]["global_step"] == whole[r]["global_step"] == 16
        # every rank resumed from its own optimizer state (they differ: each rank's own gradients)
        assert_same_state(resumed[r]["start_opt_state"], first[r]["end_opt_state"], f"rank {r} resumed state")
        for name, tensor in whole[r]["end"].items():
            assert torch.equal(resumed[r]["end"][name], tensor), (strategy, r, name)
    if strategy != "horovod":  # averaging gives every rank the same state; Adasum does not
        with pytest.raises(AssertionError):
            assert_same_state(first[0]["end_opt_state"], first[1]["end_opt_state"], "ranks' own states")
    # ModelCheckpoint kept only the last epoch: the removed checkpoint took its rank file with it
    assert sorted(p.name for p in checkpoint_of(tmp_path / "whole").parent.iterdir()) == [
        "epoch=1-step=16.ckpt",
        "epoch=1-step=16.ckpt.rank1-optimizer.pt",
    ]


@pytest.mark.parametrize("strategy", ["ddp_adasum", "horovod_adasum", "horovod"])
@pytest.mark.parametrize("old, new", [(2, 4), (4, 2), (2, 1)])
def test_resume_at_another_world_size_maps_old_ranks_to_new(strategy, old, new, tmp_path):
    if strategy != "ddp_adasum" and (old, new) == (2, 1):
        pytest.skip("one process under horovodrun is the 2 → 1 case of ddp_adasum")
    saved = fit(strategy, old, tmp_path / "saved", "--epochs", "1", "--lr", "0.05")
    ckpt = checkpoint_of(tmp_path / "saved")
    resumed = resume(strategy, new, tmp_path / "resumed", ckpt, "--lr", "0.05")
    assert_ranks_identical(resumed)
    factor = new if strategy == "horovod" else 1  # lr_scaling="auto" at the new world size
    for r, res in enumerate(resumed):
        assert res["world_size"] == new and res["global_step_start"] == STEPS_PER_EPOCH[old]
        assert res["global_step"] == STEPS_PER_EPOCH[old] + STEPS_PER_EPOCH[new]
        assert_same_state(res["start_opt_state"], saved[r % old]["end_opt_state"], f"new rank {r}")
        assert res["lrs"][0] == pytest.approx(0.05 * factor)


def test_a_ddp_checkpoint_resumes_under_ddp_adasum_from_rank_zeros_state(tmp_path):
    saved = fit("ddp", 2, tmp_path / "ddp", "--epochs", "1", "--lr", "0.05")
    ckpt = checkpoint_of(tmp_path / "ddp")
    assert RANK_OPTIMIZER_STATES not in torch.load(ckpt, weights_only=False)
    resumed = resume("ddp_adasum", 2, tmp_path / "adasum", ckpt, "--lr", "0.05")
    assert_ranks_identical(resumed)
    for res in resumed:  # under ddp every rank's state was the same; the checkpoint holds it
        assert res["global_step_start"] == 8 and res["global_step"] == 16
        assert_same_state(res["start_opt_state"], saved[0]["end_opt_state"], "ddp state")


def test_a_horovod_adasum_checkpoint_resumes_under_ddp_adasum_with_each_ranks_state(tmp_path):
    saved = fit("horovod_adasum", 2, tmp_path / "horovod", "--epochs", "1", "--lr", "0.05")
    ckpt = checkpoint_of(tmp_path / "horovod")
    resumed = resume("ddp_adasum", 2, tmp_path / "ddp", ckpt, "--lr", "0.05")
    assert_ranks_identical(resumed)
    for r, res in enumerate(resumed):
        assert_same_state(res["start_opt_state"], saved[r]["end_opt_state"], f"rank {r}")


def test_a_missing_rank_file_resumes_that_rank_from_rank_zeros_state_with_a_warning(tmp_path):
    saved = fit("ddp_adasum", 2, tmp_path / "saved", "--epochs", "1", "--lr", "0.05")
    ckpt = checkpoint_of(tmp_path / "saved")
    Path(rank_optimizer_path(ckpt, 1)).unlink()
    out = tmp_path / "resumed"
    proc = run_lightning(2, "fit", str(out), "--strategy", "ddp_adasum", "--epochs", "2", "--ckpt-path",
                         str(ckpt), "--lr", "0.05")  # fmt: skip
    resumed = load_ranks(out, 2)
    assert f"[rank 1] {rank_optimizer_path(ckpt, 1)} is missing" in proc.stderr
    assert_same_state(resumed[1]["start_opt_state"], saved[0]["end_opt_state"], "rank 0's state on rank 1")
    assert_ranks_identical(resumed)


def test_horovod_after_lr_find_warns_that_it_multiplied_the_learning_rate(tmp_path):
    proc = run_horovod(2, "fit", str(tmp_path), "--strategy", "horovod", "--epochs", "1", "--lr-find",
                       "--samples", "256")  # fmt: skip
    ranks = load_ranks(tmp_path, 2)
    suggestion = ranks[0]["lr_find_suggestion"]
    assert suggestion is not None and all(res["lr_find_suggestion"] == suggestion for res in ranks)
    for res in ranks:
        assert res["start_lr"] == pytest.approx(2 * suggestion)  # what the warning says
    message = scaled_learning_rate_message("horovod", 2.0)
    assert proc.stderr.count(message) + proc.stdout.count(message) >= 1
