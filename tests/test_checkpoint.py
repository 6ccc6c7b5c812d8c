"""The checkpoint module's guarantees in one process (``adasum_lightning.checkpoint``): files renamed into
place, every companion file tied to its save, and a missing, truncated or mismatched one named with the fix.
The same on every rank of real launches: ``tests/test_resume.py`` (``ddp_adasum``) and
``tests/test_fsdp_adasum.py`` (``fsdp_adasum``'s rank files and sharded folders)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from adasum_lightning import checkpoint as ckpt
from adasum_lightning.checkpoint import IncompleteCheckpointError
from tests.workers.lightning import pl
from tests.workers.tiny import TinyModule


def one_rank(value):
    return value  # the broadcast of a world of one


def test_a_killed_writer_leaves_the_previous_file_and_no_temporary(tmp_path):
    path = tmp_path / "last.ckpt"
    ckpt.save_file({"step": 1}, path)

    def killed(name: str) -> None:
        with open(name, "wb") as f:
            f.write(b"half a checkpoint")
        raise KeyboardInterrupt  # the writer stops mid-file

    with pytest.raises(KeyboardInterrupt):
        ckpt.written_in_place(path, killed)
    assert torch.load(path, weights_only=False) == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    ckpt.save_file({"step": 2}, path)
    assert torch.load(path, weights_only=False) == {"step": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_a_rank_file_is_tied_to_its_save(tmp_path):
    path = str(tmp_path / "last.ckpt")
    identity = ckpt.save_identity(20, one_rank)
    assert identity["global_step"] == 20 and len(identity["save_id"]) == 32
    ckpt.save_rank_file(path, 1, ["state of rank 1"], identity)
    ckpt.commit_rank_file(path, 1, barrier=lambda: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt.rank1-optimizer.pt"]
    saved = torch.load(ckpt.rank_optimizer_path(path, 1), weights_only=False)
    assert saved == {"optimizer_states": ["state of rank 1"], "rank": 1, "adasum_save_identity": identity}
    assert ckpt.load_rank_optimizer_states(path, 1, 3, identity, fallback=False) == ["state of rank 1"]
    assert ckpt.load_rank_optimizer_states(path, 0, 2, identity, fallback=False) is None  # rank 0's: inside
    newer = ckpt.save_identity(25, one_rank)
    with pytest.raises(IncompleteCheckpointError) as info:
        ckpt.load_rank_optimizer_states(path, 1, 3, newer, fallback=False)
    assert str(info.value) == (
        f"rank 3: {path}.rank1-optimizer.pt (step 20, save {identity['save_id'][:8]}) is from another save "
        f"than checkpoint {path} (step 25, save {newer['save_id'][:8]}): a save was interrupted between the "
        "files, or they were copied from different saves. Resume from another checkpoint, or pass "
        "ckpt_path=None to start from scratch."
    )
    assert ckpt.load_rank_optimizer_states(path, 1, 1, None, fallback=False) == ["state of rank 1"]  # older


def test_a_missing_or_truncated_rank_file_is_named_with_the_fix(tmp_path):
    path = str(tmp_path / "last.ckpt")
    identity = ckpt.save_identity(8, one_rank)
    assert ckpt.load_rank_optimizer_states(path, 1, 1, identity, fallback=True) is None  # ddp_adasum's
    with pytest.raises(IncompleteCheckpointError) as info:
        ckpt.load_rank_optimizer_states(path, 1, 1, identity, fallback=False)
    assert str(info.value) == (
        f"rank 1: {path}.rank1-optimizer.pt is missing: rank 1's optimizer shard of checkpoint {path} (no "
        "rank resumes from another rank's shard). Copy the <checkpoint>.rank<r>-optimizer.pt files with the "
        "checkpoint, or resume from another checkpoint."
    )
    ckpt.save_rank_file(path, 1, ["state"], identity)
    ckpt.commit_rank_file(path, 1, barrier=lambda: None)
    rank_file = ckpt.rank_optimizer_path(path, 1)
    with open(rank_file, "r+b") as f:
        f.truncate(os.path.getsize(rank_file) // 2)
    with pytest.raises(IncompleteCheckpointError) as info:
        ckpt.load_rank_optimizer_states(path, 1, 1, identity, fallback=True)
    message = str(info.value)
    assert message.startswith(
        f"rank 1: {rank_file} (rank 1's optimizer state of checkpoint {path}) could not be read "
        "(RuntimeError: PytorchStreamReader failed"
    )
    assert message.endswith(
        "it is truncated or corrupt. Resume from another checkpoint, or delete it to resume rank 1 from rank "
        "0's optimizer state, or pass ckpt_path=None to start from scratch."
    )


def test_a_save_cut_short_leaves_the_rank_file_of_the_checkpoints_own_save(tmp_path):
    path = str(tmp_path / "last.ckpt")
    rank_file = ckpt.rank_optimizer_path(path, 1)
    old = ckpt.save_identity(20, one_rank)
    ckpt.save_rank_file(path, 1, ["step 20"], old)
    ckpt.commit_rank_file(path, 1, barrier=lambda: None)
    new = ckpt.save_identity(25, one_rank)
    ckpt.save_rank_file(path, 1, ["step 25"], new)  # the host is lost here: last.ckpt is still step 20's
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "last.ckpt.rank1-optimizer.pt",
        "last.ckpt.rank1-optimizer.pt.next",
    ]
    assert ckpt.load_rank_optimizer_states(path, 1, 1, old, fallback=False) == ["step 20"]
    # lost after rank 0 wrote step 25's last.ckpt, before the barrier: the pending file is that save's
    assert ckpt.load_rank_optimizer_states(path, 1, 1, new, fallback=False) == ["step 25"]

    def lost_peer() -> None:
        raise RuntimeError("Connection closed by peer")

    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        ckpt.commit_rank_file(path, 1, barrier=lost_peer)
    assert torch.load(rank_file, weights_only=False)["optimizer_states"] == ["step 20"]  # not committed
    ckpt.commit_rank_file(path, 1, barrier=lambda: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt.rank1-optimizer.pt"]
    assert ckpt.load_rank_optimizer_states(path, 1, 1, new, fallback=False) == ["step 25"]
    with pytest.raises(IncompleteCheckpointError, match="is from another save than checkpoint"):
        ckpt.load_rank_optimizer_states(path, 1, 1, old, fallback=False)
    ckpt.remove_rank_file(path, 1)
    assert list(tmp_path.iterdir()) == []


def save_folder(folder, step: int, value: float) -> dict:
    identity = ckpt.save_identity(step, one_rank)
    ckpt.save_sharded(folder, {"model.w": torch.full((3,), value)}, {"global_step": step}, identity)
    return identity


def test_a_sharded_folder_is_swapped_whole_and_checked_against_its_meta(tmp_path):
    folder = tmp_path / "last.ckpt"
    save_folder(folder, 1, 1.0)
    identity = save_folder(folder, 2, 2.0)  # over the first: swapped, nothing left beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert ckpt.read_sharded_meta(folder) == {"global_step": 2}
    target = {"model.w": torch.zeros(3)}
    ckpt._dcp_load(target, folder)
    assert torch.equal(target["model.w"], torch.full((3,), 2.0))
    other = tmp_path / "other.ckpt"
    theirs = save_folder(other, 3, 3.0)
    shutil.copy2(other / "meta.pt", folder / "meta.pt")
    with pytest.raises(IncompleteCheckpointError) as info:
        ckpt.read_sharded_meta(folder)
    assert str(info.value) == (
        f"{folder}/meta.pt (step 3, save {theirs['save_id'][:8]}) is from another save than the shards "
        "beside it: a save was interrupted, or files were copied from different saves. Resume from another "
        "checkpoint."
    )
    assert identity != theirs


def test_a_damaged_sharded_folder_is_named_with_the_fix(tmp_path):
    folder = tmp_path / "last.ckpt"
    save_folder(folder, 1, 1.0)
    (folder / "__0_0.distcp").unlink()
    with pytest.raises(IncompleteCheckpointError) as info:
        ckpt.read_sharded_meta(folder)
    assert str(info.value) == (
        f"{folder}/__0_0.distcp (rank 0's shards) is missing. Resume from another checkpoint, or pass "
        "ckpt_path=None to start from scratch."
    )
    (folder / "meta.pt").write_bytes(b"")
    with pytest.raises(IncompleteCheckpointError, match=r"meta.pt \(written by rank 0\) could not be read"):
        ckpt.read_sharded_meta(folder)
    (folder / "meta.pt").unlink()
    with pytest.raises(IncompleteCheckpointError) as info:
        ckpt.read_sharded_meta(folder)
    assert str(info.value) == (
        f"{folder}/meta.pt (written by rank 0) is missing from the sharded checkpoint. Resume from another "
        "checkpoint, or pass ckpt_path=None to start from scratch."
    )


# ---------------------------------------------------------------- a Trainer given a checkpoint it cannot read
def test_missing_checkpoint_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"Checkpoint file not found: .*nope\.ckpt"):  # Lightning's
        pl.Trainer(strategy="horovod_adasum", accelerator="cpu", logger=False, enable_progress_bar=False).fit(
            TinyModule(), ckpt_path=str(tmp_path / "nope.ckpt")
        )


@pytest.mark.parametrize("content", [b"garbage", b"", b"junk\n"])  # "junk": a KeyError in the unpickler
def test_corrupt_checkpoint_names_the_fix(tmp_path, content):
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(content)
    model = TinyModule()
    with pytest.raises(
        RuntimeError, match=r"could not be read on rank 0 .*truncated, corrupt or not a Lightning"
    ):
        pl.Trainer(strategy="horovod_adasum", accelerator="cpu", logger=False, enable_progress_bar=False).fit(
            model, ckpt_path=str(bad)
        )
    assert model.record["indices"] == []


def test_checkpoint_without_state_dict_is_refused(tmp_path):
    other = tmp_path / "weights.pt"
    torch.save({"weights": torch.ones(2)}, other)
    with pytest.raises(RuntimeError, match="holds no 'state_dict': it is not a Lightning checkpoint"):
        pl.Trainer(strategy="horovod_adasum", accelerator="cpu", logger=False, enable_progress_bar=False).fit(
            TinyModule(), ckpt_path=str(other)
        )
