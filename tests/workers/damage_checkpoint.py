"""Worker: rank 0 copies a checkpoint with its companion files into OUT and damages the copy; the other
ranks wait for it.

usage: python -m tests.workers.damage_checkpoint OUT SOURCE MODE [ARG] [--devices N]
(--devices is unused: Lightning's launch passes it)

SOURCE is a checkpoint file, a sharded checkpoint folder (it holds ``meta.pt``) or a folder holding exactly
one ``*.ckpt``; the copy keeps its name, beside its ``.rank<r>-optimizer.pt`` files. MODE:

- ``drop R``: delete rank R's optimizer file (a lost rank file);
- ``truncate R``: cut rank R's optimizer file to half its length (a writer killed mid-file);
- ``other-save OTHER``: rank 1's optimizer file taken from checkpoint OTHER (resolved as SOURCE): a file
  of another save beside the checkpoint;
- ``cut-after-checkpoint OTHER``: a save cut short after rank 0 wrote the checkpoint: rank 1's file of
  this save pending (``.next``), its committed file taken from checkpoint OTHER;
- ``cut-before-checkpoint OTHER``: a save cut short before rank 0 wrote its checkpoint: rank 1's file of
  checkpoint OTHER pending beside this save's files;
- ``truncate-meta``: cut a sharded folder's ``meta.pt`` to half its length;
- ``drop-shard``: delete a sharded folder's ``__1_0.distcp`` (rank 1's shards).
"""

import os
import shutil
from pathlib import Path

import torch.distributed as dist

from adasum_lightning.checkpoint import PENDING, rank_optimizer_path
from tests.workers import cases


def resolve(source: str) -> Path:
    path = Path(source)
    if path.is_dir() and not (path / "meta.pt").exists():
        (path,) = path.rglob("*.ckpt")
    return path


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


argv = cases.argv()
out, source, mode, arg = Path(argv[0]), resolve(argv[1]), argv[2], (argv[3:4] or [""])[0]
if cases.rank() == 0:
    out.mkdir(parents=True, exist_ok=True)
    copy = out / source.name
    if source.is_dir():
        shutil.copytree(source, copy)
    else:
        for file in [source, *source.parent.glob(f"{source.name}.rank*-optimizer.pt")]:
            shutil.copy2(file, out / file.name)
    if mode == "drop":
        Path(rank_optimizer_path(copy, int(arg))).unlink()
    elif mode == "truncate":
        truncate(Path(rank_optimizer_path(copy, int(arg))))
    elif mode == "other-save":
        shutil.copy2(rank_optimizer_path(resolve(arg), 1), rank_optimizer_path(copy, 1))
    elif mode == "cut-after-checkpoint":
        os.replace(rank_optimizer_path(copy, 1), rank_optimizer_path(copy, 1) + PENDING)
        shutil.copy2(rank_optimizer_path(resolve(arg), 1), rank_optimizer_path(copy, 1))
    elif mode == "cut-before-checkpoint":
        shutil.copy2(rank_optimizer_path(resolve(arg), 1), rank_optimizer_path(copy, 1) + PENDING)
    elif mode == "truncate-meta":
        truncate(copy / "meta.pt")
    elif mode == "drop-shard":
        (copy / "__1_0.distcp").unlink()
    else:
        raise ValueError(f"unknown mode {mode!r}")
# The other ranks go on to the next case (a resume from this copy) only once the copy is complete. Where no
# fit of the launch has run yet there is no default group, and Lightning's launcher has not started them.
if dist.is_initialized():
    dist.barrier()
