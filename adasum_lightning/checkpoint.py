"""What adasum-lightning adds to a checkpoint, for both Lightning APIs (``torch`` only).

Every rank (every replica group under ``fsdp_adasum``) keeps its own optimizer state: rank 0's goes in the
checkpoint, rank r's beside it (``<checkpoint>.rank<r>-optimizer.pt``); ``state_dict_type="sharded"`` is a
``torch.distributed.checkpoint`` folder with ``meta.pt``; local SGD adds its window state. Every file is
renamed into place (a sharded folder swapped whole); every save's identity is in each of its files and
checked on resume, on every rank; rank files are committed in two phases, so that a save cut short leaves
the rank files of the checkpoint's own save.
"""

from __future__ import annotations

import os
import pickle
import shutil
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn import Module
from torch.optim import Optimizer

from adasum_lightning.errors import AdasumConfigurationError

__all__ = [
    "IncompleteCheckpointError",
    "Filter",
    "RANK_OPTIMIZER_STATES",
    "SAVE_IDENTITY",
    "SAVED_WORLD_SIZE",
    "PENDING",
    "SHARDED_OPTIMIZER_MESH",
    "SHARDED_LAYOUTS",
    "SHARDED_META",
    "PERIODIC_SYNC_STATES",
    "STATE_DICT_TYPES",
    "READ_ERRORS",
    "rank_optimizer_path",
    "source_rank",
    "resume_line",
    "save_identity",
    "save_file",
    "save_through",
    "check_strict_keys",
    "read_checkpoint",
    "written_in_place",
    "save_rank_file",
    "commit_rank_file",
    "remove_rank_file",
    "load_rank_optimizer_states",
    "refuse_on_every_rank",
    "window_states",
    "convert_state",
    "restore_state",
    "save_sharded",
    "read_sharded_meta",
    "remove_sharded",
    "sharded_model_state",
    "load_sharded_model_state",
    "sharded_optimizer_entries",
    "load_sharded_optimizer_state",
    "check_state_dict_type",
    "check_resume_mesh",
    "check_sharded_save_filter",
    "unreadable_checkpoint",
]

#: The checkpoint's record of a save of every rank's optimizer state: ``{"world_size": N, "lr_factor": f}``.
RANK_OPTIMIZER_STATES = "adasum_rank_optimizer_states"
#: What identifies one save (:func:`save_identity`), in the checkpoint and in each of its companion files.
SAVE_IDENTITY = "adasum_save_identity"
#: The world size of the save, in the checkpoints of Fabric's ``ddp_adasum`` (the Trainer's strategies keep it
#: in :data:`RANK_OPTIMIZER_STATES`).
SAVED_WORLD_SIZE = "adasum_world_size"
#: The mesh ``[replica groups, shard_size]`` whose ranks saved their own optimizer shards (``fsdp_adasum``).
SHARDED_OPTIMIZER_MESH = "adasum_sharded_optimizer_mesh"
#: The key of a sharded folder's ``meta.pt`` with each optimizer's state layout.
SHARDED_LAYOUTS = "adasum_sharded_optimizer_layouts"
#: The strategies' local-SGD windows: per optimizer, ``PeriodicSync.state_dict`` without θ_sync (a
#: checkpoint is written after a sync, where θ_sync is the parameters).
PERIODIC_SYNC_STATES = "adasum_periodic_sync_states"
#: The file of a sharded folder that holds everything but the tensors (written by rank 0).
SHARDED_META = "meta.pt"
#: The layouts of ``fsdp_adasum``'s checkpoints.
STATE_DICT_TYPES = ("full", "sharded")
#: What ``torch.load`` raises for a file it cannot read; a corrupt pickle stream can also fail in a memo
#: lookup (``KeyError``, ``IndexError``).
READ_ERRORS = (pickle.UnpicklingError, EOFError, RuntimeError, ValueError, OSError, KeyError, IndexError)

#: ``fabric.save``'s ``filter``: per key of the state, which of its items to keep.
Filter = Mapping[str, Callable[[str, Any], bool]]

#: The suffix of a rank file written but not committed yet (:func:`commit_rank_file`).
PENDING = ".next"
#: The sharded folder's entry with the save id (16 bytes as ``uint8``), checked against ``meta.pt``'s.
_SAVE_ID_ENTRY = "adasum_save_id"


class IncompleteCheckpointError(RuntimeError):
    """A file of a checkpoint is missing, unreadable or from another save; raised on every rank, naming the
    file, the rank that needs it and the fix."""


# ----------------------------------------------------------------------------- identity
def rank_optimizer_path(checkpoint_path: Any, rank: int) -> str:
    """Where rank ``rank`` (≥ 1) keeps its optimizer state of the checkpoint ``checkpoint_path``."""
    return f"{checkpoint_path}.rank{rank}-optimizer.pt"


def source_rank(rank: int, saved_world_size: int) -> int:
    """The saved rank (or replica group) whose optimizer state ``rank`` resumes from: ``rank mod N_old``."""
    return rank % int(saved_world_size)


def resume_line(owner: str, path: Any, step: Any, saved_world_size: Any, world_size: int) -> str:
    """Rank 0's line after a resume: the file, the step, the world size saved and now, torchrun's restart
    count (``TORCHELASTIC_RESTART_COUNT``, shown when not 0)."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return (
        f"{owner}: resumed from {path} at step {step} (world size {saved_world_size or '?'} -> {world_size}"
        + (f"; torchrun restart {restart}" if restart != "0" else "")
        + "); the steps since that checkpoint were lost"
    )


def save_identity(step: Any, broadcast: Callable[[Any], Any]) -> dict[str, Any]:
    """What identifies this save: ``{"global_step": step, "save_id": rank 0's random hex id}``.

    ``broadcast`` gives every rank rank 0's object (a collective: every rank calls this, as every rank saves).
    """
    return {"global_step": step if isinstance(step, int) else None, "save_id": broadcast(uuid.uuid4().hex)}


def _describe(identity: Mapping[str, Any] | None) -> str:
    if not identity:
        return "no save record (an older version)"
    return f"step {identity.get('global_step')}, save {str(identity.get('save_id'))[:8]}"


# ----------------------------------------------------------------------------- files
def written_in_place(path: Any, write: Callable[[str], None], in_place: bool = True) -> None:
    """``write(name)`` to a temporary name in ``path``'s folder, then renamed to ``path`` (``os.replace``):
    a killed writer leaves the old file or the new one. Paths with a URL scheme, and writers that finish
    later (``in_place=False``: a checkpoint IO other than Lightning's own, e.g. an asynchronous one), are
    written directly."""
    path = os.fspath(path)
    if "://" in path or not in_place:
        write(path)
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    temporary = f"{path}.tmp-{os.getpid()}"
    try:
        write(temporary)
        os.replace(temporary, path)
    finally:
        if os.path.lexists(temporary):
            os.remove(temporary)


def save_through(
    checkpoint_io: Any, checkpoint: Any, path: Any, storage_options: Any, in_place: bool
) -> None:
    """``checkpoint_io.save_checkpoint(checkpoint, name, storage_options=...)`` (Lightning's ``CheckpointIO``
    interface), renamed into place where ``in_place`` (:func:`written_in_place`)."""

    def write(name: str) -> None:
        checkpoint_io.save_checkpoint(checkpoint, name, storage_options=storage_options)

    written_in_place(path, write, in_place)


def save_file(obj: Any, path: Any) -> None:
    """``torch.save(obj)`` to ``path``, renamed into place (:func:`written_in_place`)."""
    written_in_place(path, lambda name: torch.save(obj, name))


def read_checkpoint(load: Callable[[], Any], path: Any, rank: int) -> dict[str, Any]:
    """``load()`` of the Lightning checkpoint ``path`` on rank ``rank``; a file that is truncated, corrupt or
    not a Lightning checkpoint raises RuntimeError with the fix (a missing one Lightning's FileNotFoundError).
    """
    try:
        checkpoint = load()
    except FileNotFoundError:
        raise
    except READ_ERRORS as err:
        raise unreadable_checkpoint(path, err, rank) from err
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise RuntimeError(
            f"checkpoint {path} holds no 'state_dict': it is not a Lightning checkpoint. Pass a file written "
            "by Trainer.fit (ModelCheckpoint), or ckpt_path=None."
        )
    return checkpoint


def _load_file(path: Any) -> Any:
    return torch.load(path, map_location="cpu", weights_only=False)


def refuse_on_every_rank(problem: str | None) -> None:
    """Raise every rank's problem on every rank (a collective over the default group when it has several
    ranks: every rank calls this, with None where it found nothing).
    Raises IncompleteCheckpointError: the problems of all ranks, in rank order.
    """
    problems = [problem]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
    found = list(dict.fromkeys(p for p in problems if p))  # a shared file's problem once
    if found:
        raise IncompleteCheckpointError(" ".join(found))


# ----------------------------------------------------------------------------- rank files
def save_rank_file(
    checkpoint_path: Any, rank: int, optimizer_states: Any, identity: Mapping[str, Any]
) -> None:
    """Rank ``rank``'s optimizer state, with the save's identity, to its rank file + :data:`PENDING`; the
    file replaces the rank file in :func:`commit_rank_file`, once the checkpoint is in place."""
    own = {"optimizer_states": optimizer_states, "rank": rank, SAVE_IDENTITY: dict(identity)}
    save_file(own, rank_optimizer_path(checkpoint_path, rank) + PENDING)


def commit_rank_file(checkpoint_path: Any, rank: int, barrier: Callable[[], Any]) -> None:
    """After ``barrier`` (a collective that every rank calls once rank 0 has written the checkpoint), rank
    ``rank``'s pending file becomes its rank file. A save cut short before leaves the old checkpoint with its
    rank files; one cut short after leaves the new checkpoint with its pending files, which a resume reads."""
    barrier()
    path = rank_optimizer_path(checkpoint_path, rank)
    if os.path.exists(path + PENDING):
        os.replace(path + PENDING, path)


def remove_rank_file(checkpoint_path: Any, rank: int) -> None:
    path = rank_optimizer_path(checkpoint_path, rank)
    for name in (path, path + PENDING):
        if os.path.lexists(name):
            os.remove(name)


def load_rank_optimizer_states(
    checkpoint_path: Any,
    source: int,
    rank: int,
    identity: Mapping[str, Any] | None,
    fallback: bool,
) -> Any:
    """Old rank ``source``'s optimizer states from beside ``checkpoint_path`` for rank ``rank``; a collective:
    every rank calls it (``source`` 0 reads nothing), so that a problem is raised on every rank.

    Args:
        identity: the checkpoint's :data:`SAVE_IDENTITY` (None: written before it existed, not checked).
        fallback: a missing file returns None (the caller resumes from rank 0's state with a warning)
            instead of refusing.

    Raises:
        IncompleteCheckpointError: on every rank, a rank file missing (without ``fallback``), unreadable or
            from another save than the checkpoint; the message names both files and the fix.
    """
    states, problem = None, None
    if source != 0:
        states, problem = _read_rank_file(checkpoint_path, source, rank, identity, fallback)
    refuse_on_every_rank(problem)
    return states


def _read_rank_file(
    checkpoint_path: Any, source: int, rank: int, identity: Mapping[str, Any] | None, fallback: bool
) -> tuple[Any, str | None]:
    path = rank_optimizer_path(checkpoint_path, source)
    pending = _pending_of_save(path + PENDING, identity)
    if pending is not None:  # the checkpoint was written, the rank file not committed yet
        return pending["optimizer_states"], None
    instead = f"delete it to resume rank {rank} from rank 0's optimizer state, or " if fallback else ""
    try:
        saved = _load_file(path)
    except FileNotFoundError:
        if fallback:
            return None, None
        return None, (
            f"rank {rank}: {path} is missing: rank {source}'s optimizer shard of checkpoint "
            f"{checkpoint_path} (no rank resumes from another rank's shard). Copy the "
            "<checkpoint>.rank<r>-optimizer.pt files with the checkpoint, or resume from another checkpoint."
        )
    except READ_ERRORS as err:
        first_line = (str(err).splitlines() or [""])[0][:200]
        return None, (
            f"rank {rank}: {path} (rank {source}'s optimizer state of checkpoint {checkpoint_path}) could "
            f"not be read ({type(err).__name__}: {first_line}): it is truncated or corrupt. Resume from "
            f"another checkpoint, or {instead}pass ckpt_path=None to start from scratch."
        )
    found = saved.get(SAVE_IDENTITY) if isinstance(saved, dict) else None
    if identity is not None and found != dict(identity):
        return None, (
            f"rank {rank}: {path} ({_describe(found)}) is from another save than checkpoint "
            f"{checkpoint_path} ({_describe(identity)}): a save was interrupted between the files, or they "
            f"were copied from different saves. Resume from another checkpoint, or {instead}pass "
            "ckpt_path=None to start from scratch."
        )
    return saved["optimizer_states"], None


def _pending_of_save(path: str, identity: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The pending rank file ``path`` when it is of the save ``identity`` (else None: absent, unreadable or of
    another save, a save that was cut short before its checkpoint was written)."""
    if identity is None or not os.path.exists(path):
        return None
    try:
        saved = _load_file(path)
    except READ_ERRORS:
        return None
    return saved if isinstance(saved, dict) and saved.get(SAVE_IDENTITY) == dict(identity) else None


# ----------------------------------------------------------------------------- windows
def window_states(windows: Sequence[Any]) -> list[dict[str, Any]]:
    """:data:`PERIODIC_SYNC_STATES` of each optimizer's ``PeriodicSync`` (None: it has not stepped yet)."""
    return [
        {**(w.state_dict() if w is not None else {"steps": 0, "outer_optimizer": None}), "synced": None}
        for w in windows
    ]


# ----------------------------------------------------------------------------- Fabric's state
def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def convert_state(
    state: Mapping[str, Any],
    module_state: Callable[[Module], Any],
    optimizer_state: Callable[[Optimizer], Any],
    filter: Filter | None,
) -> tuple[dict[str, Any], list[str]]:
    """``fabric.save``'s state as plain values (modules and optimizers through the given functions, other
    stateful objects by ``state_dict()``, ``filter`` applied per key), and the keys of the optimizers."""
    converted, optimizers = {}, []
    for key, obj in state.items():
        if isinstance(obj, Module):
            value: Any = module_state(obj)
        elif isinstance(obj, Optimizer):
            value = optimizer_state(obj)
            optimizers.append(key)
        else:
            value = obj.state_dict() if _is_stateful(obj) else obj
        keep = (filter or {}).get(key)
        if keep is not None and isinstance(value, Mapping):
            value = {k: v for k, v in value.items() if keep(k, v)}
        converted[key] = value
    return converted, optimizers


def check_strict_keys(missing: Sequence[str], strict: bool) -> None:
    """``fabric.load``'s strict loading: ``missing`` are the requested keys the checkpoint lacks.
    Raises KeyError: with ``strict``, naming the first (Fabric's message).
    """
    if strict and missing:
        raise KeyError(
            f"The requested state contains a key '{missing[0]}' that does not exist in the loaded "
            "checkpoint. To disable strict loading, set `strict=False`."
        )


def restore_state(
    state: dict[str, Any],
    checkpoint: dict[str, Any],
    strict: bool,
    load_module: Callable[[Module, Any], None],
    load_optimizer: Callable[[str, Optimizer, Any], None],
) -> dict[str, Any]:
    """``fabric.load``'s restore of ``state`` from ``checkpoint`` (modules and optimizers through the given
    functions); returns what ``state`` did not name.
    Raises KeyError: with ``strict``, a key of ``state`` that the checkpoint lacks (Fabric's message).
    """
    check_strict_keys([k for k in state if k not in checkpoint], strict)
    for key, obj in list(state.items()):
        if key not in checkpoint:
            continue
        value = checkpoint.pop(key)
        if isinstance(obj, Module):
            load_module(obj, value)
        elif isinstance(obj, Optimizer):
            load_optimizer(key, obj, value)
        elif _is_stateful(obj):
            obj.load_state_dict(value)
        else:
            state[key] = value
    return checkpoint


# ----------------------------------------------------------------------------- sharded folders
def _id_tensor(save_id: str) -> torch.Tensor:
    return torch.tensor(list(bytes.fromhex(save_id)), dtype=torch.uint8)


def save_sharded(
    folder: Any, tensors: dict[str, Any], meta: dict[str, Any] | None, identity: Mapping[str, Any]
) -> None:
    """Write a sharded checkpoint: ``tensors`` (this rank's entries: ``DTensor`` shards and plain tensors,
    possibly other keys than the other ranks') through ``torch.distributed.checkpoint`` (a collective over
    the default group), and ``meta`` (on the rank that passes it, with the identity) in ``meta.pt``.

    Entries saved by several ranks under the same key and offsets (the replicas of a shard) are written once.
    The folder is written as ``<folder>.tmp-<save id>`` and swapped into place by the rank with ``meta``:
    an interrupted save leaves the previous folder, or none, never a mix.
    """
    import torch.distributed.checkpoint as dcp

    final = Path(folder)
    temporary = final.with_name(f"{final.name}.tmp-{identity['save_id']}")
    if meta is not None:
        tensors = {**tensors, _SAVE_ID_ENTRY: _id_tensor(identity["save_id"])}
    dcp.save(tensors, checkpoint_id=temporary)  # returns once every rank's files and .metadata are written
    if meta is None:
        return
    save_file({**meta, SAVE_IDENTITY: dict(identity)}, temporary / SHARDED_META)
    if final.is_dir():
        old = final.with_name(f"{final.name}.old-{identity['save_id']}")
        os.replace(final, old)
        os.replace(temporary, final)
        shutil.rmtree(old)
    else:
        os.replace(temporary, final)


def remove_sharded(folder: Any) -> None:
    shutil.rmtree(folder)


def _shard_writer(name: str) -> str:
    """Who wrote a file of a sharded folder: ``__<rank>_<n>.distcp`` is rank ``<rank>``'s shards."""
    parts = name.removeprefix("__").split("_")
    return f"rank {parts[0]}'s shards" if name.startswith("__") and parts[0].isdigit() else "shards"


def _sharded_problem(folder: Path) -> tuple[dict[str, Any] | None, str | None]:
    from torch.distributed.checkpoint import FileSystemReader

    fix = "Resume from another checkpoint, or pass ckpt_path=None to start from scratch."
    try:
        meta = _load_file(folder / SHARDED_META)
        if not isinstance(meta, dict):
            raise ValueError(f"it holds a {type(meta).__name__}, not a dict")
    except FileNotFoundError:
        return (
            None,
            f"{folder / SHARDED_META} (written by rank 0) is missing from the sharded checkpoint. {fix}",
        )
    except READ_ERRORS as err:
        first_line = (str(err).splitlines() or [""])[0][:200]
        return None, (
            f"{folder / SHARDED_META} (written by rank 0) could not be read ({type(err).__name__}: "
            f"{first_line}): it is truncated or corrupt. {fix}"
        )
    try:
        stored = {i.relative_path for i in FileSystemReader(folder).read_metadata().storage_data.values()}
    except Exception as err:  # torch.distributed.checkpoint's own metadata file
        first_line = (str(err).splitlines() or [""])[0][:200]
        return None, f"{folder}/.metadata could not be read ({type(err).__name__}: {first_line}). {fix}"
    missing = sorted(name for name in stored if not (folder / name).is_file())
    if missing:
        return None, f"{folder / missing[0]} ({_shard_writer(missing[0])}) is missing. {fix}"
    return meta, None


def read_sharded_meta(folder: Any) -> dict[str, Any]:
    """A sharded folder's ``meta.pt`` once its files are checked: ``meta.pt`` readable, every file that
    ``torch.distributed.checkpoint``'s metadata names present, and the same save as the shards. A collective.
    Raises IncompleteCheckpointError: on every rank, naming the file, the rank that wrote it and the fix.
    """
    folder = Path(os.path.realpath(folder))
    meta, problem = _sharded_problem(folder)
    refuse_on_every_rank(problem)
    assert meta is not None
    identity = meta.pop(SAVE_IDENTITY, None)
    if identity is not None:
        target = {_SAVE_ID_ENTRY: torch.zeros(16, dtype=torch.uint8)}
        _dcp_load(target, folder)
        if not torch.equal(target[_SAVE_ID_ENTRY], _id_tensor(identity["save_id"])):
            refuse_on_every_rank(
                f"{folder / SHARDED_META} ({_describe(identity)}) is from another save than the shards "
                "beside it: a save was interrupted, or files were copied from different saves. Resume from "
                "another checkpoint."
            )
    return meta


def _dcp_load(target: dict[str, Any], folder: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(target, checkpoint_id=folder)
    except (Exception, CheckpointException) as err:
        first_line = (str(err).splitlines() or [""])[0][:300]
        raise IncompleteCheckpointError(
            f"the sharded checkpoint {folder} could not be read ({type(err).__name__}: {first_line}). Resume "
            "from another checkpoint, or pass ckpt_path=None to start from scratch."
        ) from err


def sharded_model_state(module: Module, keep_plain: bool) -> dict[str, Any]:
    """``module.state_dict()`` as a sharded checkpoint's entries: the ``DTensor`` shards, and the plain
    tensors (buffers, unsharded parameters) only where ``keep_plain`` (rank 0: one rank's buffers)."""
    state = module.state_dict()
    return {k: v for k, v in state.items() if keep_plain or isinstance(v, DTensor)}


def load_sharded_model_state(module: Module, path: Any, prefix: str, strict: bool = True) -> None:
    """Fill ``module`` (sharded on any mesh, or not at all) from a sharded checkpoint's entries
    ``<prefix><name>``: ``torch.distributed.checkpoint`` reads the parts of the saved tensors that this
    rank's shards cover (resharding from another shard size). A collective over the default group."""
    target = {f"{prefix}{k}": v for k, v in module.state_dict().items()}
    _dcp_load(target, Path(path))
    module.load_state_dict({k[len(prefix) :]: v for k, v in target.items()}, strict=strict)


def sharded_optimizer_entries(
    optimizer: Optimizer, names: Mapping[int, str], key: str
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """This rank's optimizer state as a sharded checkpoint's entries ``<key>.<parameter name>.<state>``, and
    its layout ``{parameter name: {state: ("shard", dtype) | ("tensor", shape, dtype) | ("value", v)}}``.

    ``names`` maps ``id(parameter)`` to the parameter's name in its module; ``key`` names this replica
    group's copy (every group keeps its own optimizer state: e.g. ``"optimizer0.replica1"``).
    """
    entries: dict[str, torch.Tensor] = {}
    layout: dict[str, dict[str, Any]] = {}
    for p in (p for group in optimizer.param_groups for p in group["params"]):
        if p not in optimizer.state:
            continue
        name = names[id(p)]
        layout[name] = {}
        for state_name, value in optimizer.state[p].items():
            dtype = str(value.dtype).removeprefix("torch.") if torch.is_tensor(value) else ""
            if isinstance(value, DTensor):
                layout[name][state_name] = ("shard", dtype)
            elif torch.is_tensor(value):
                layout[name][state_name] = ("tensor", tuple(value.shape), dtype)
            else:
                layout[name][state_name] = ("value", value)
                continue
            entries[f"{key}.{name}.{state_name}"] = value
    return entries, layout


def load_sharded_optimizer_state(
    optimizer: Optimizer,
    names: Mapping[int, str],
    path: Any,
    key: str,
    layout: Mapping[str, Mapping[str, Any]],
    param_groups: list[dict[str, Any]],
) -> None:
    """Restore ``optimizer`` from a sharded checkpoint's entries ``<key>.…``
    (:func:`sharded_optimizer_entries` of the replica group this rank takes its state from), resharded to this
    rank's parameters' shards, with the saved ``param_groups``. A collective over the default group.
    Raises KeyError: a parameter of the layout that ``optimizer`` lacks (a checkpoint of another model).
    """
    by_name = {names[id(p)]: p for group in optimizer.param_groups for p in group["params"]}
    index = {id(p): i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    target: dict[str, torch.Tensor] = {}
    for name, entries in layout.items():
        p = by_name[name]
        for state_name, kind in entries.items():
            if kind[0] == "shard":
                assert isinstance(p, DTensor), name
                local = torch.zeros_like(p.to_local(), dtype=getattr(torch, kind[1]))
                target[f"{key}.{name}.{state_name}"] = DTensor.from_local(
                    local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                )
            elif kind[0] == "tensor":
                target[f"{key}.{name}.{state_name}"] = torch.zeros(kind[1], dtype=getattr(torch, kind[2]))
    if target:
        _dcp_load(target, Path(path))
    state = {
        index[id(by_name[name])]: {
            state_name: kind[1] if kind[0] == "value" else target[f"{key}.{name}.{state_name}"]
            for state_name, kind in entries.items()
        }
        for name, entries in layout.items()
    }
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})


# ----------------------------------------------------------------------------- rules
def check_state_dict_type(value: object, strategy_name: str = "fsdp_adasum") -> str:
    """``state_dict_type`` is ``"full"`` or ``"sharded"``; else AdasumConfigurationError."""
    if value not in STATE_DICT_TYPES:
        raise AdasumConfigurationError(
            f"{strategy_name}: state_dict_type={value!r} is not a checkpoint layout: pass "
            "state_dict_type='full' (one file, the whole model; resumes on the same mesh) or 'sharded' (a "
            "folder of shards through torch.distributed.checkpoint; resumes on any mesh)."
        )
    return value


def check_resume_mesh(
    saved: Sequence[int], current: Sequence[int], strategy_name: str = "fsdp_adasum"
) -> None:
    """A checkpoint of sharded optimizer states (every rank's own shard of its replica group's state) resumes
    on the mesh it was saved on: ``saved`` and ``current`` are ``(replica groups, shard_size)``.
    Raises AdasumConfigurationError: naming both meshes and the settings that match.
    """
    if tuple(saved) != tuple(current):
        groups, shard = saved
        raise AdasumConfigurationError(
            f"{strategy_name}: the checkpoint holds optimizer states sharded over a {groups} × {shard} mesh "
            f"(replica groups × shard_size), this run has {current[0]} × {current[1]}; a full checkpoint "
            f"resumes on its own mesh only. Resume with {groups * shard} processes and shard_size={shard}, "
            "or save with state_dict_type='sharded' (any mesh resumes from that)."
        )


def check_sharded_save_filter(has_filter: bool, strategy_name: str = "fsdp_adasum") -> None:
    """``fabric.save(..., filter=...)`` with ``state_dict_type="sharded"``: a folder of shards is written
    whole (a filtered one could not be resumed on another mesh).
    Raises AdasumConfigurationError: naming the two ways that work.
    """
    if has_filter:
        raise AdasumConfigurationError(
            f"{strategy_name}: fabric.save(..., filter=...) is not supported with state_dict_type='sharded' "
            "(the folder holds every shard): drop the filter, or save with state_dict_type='full'."
        )


def unreadable_checkpoint(path: object, err: BaseException, rank: int) -> RuntimeError:
    """The error for a checkpoint file that exists but cannot be loaded (truncated, corrupt, foreign)."""
    first_line = (str(err).splitlines() or [""])[0][:200]
    return RuntimeError(
        f"checkpoint {path} could not be read on rank {rank} ({type(err).__name__}: {first_line}). "
        "It is truncated, corrupt or not a Lightning checkpoint: pass another ckpt_path, or ckpt_path=None "
        "to start from scratch."
    )
