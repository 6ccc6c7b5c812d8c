"""Uneven inputs: every rank stops an epoch at the shortest rank's batch count, so no rank waits for the
others in a collective (docs/uneven_inputs_and_resume.md).
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset

from adasum_lightning.step import world_size

__all__ = ["EvenBatches", "UnevenInputsError", "check_uneven_inputs", "uneven_message"]


class UnevenInputsError(RuntimeError):
    """The ranks have different numbers of batches and ``uneven_inputs="error"`` was asked for."""


def check_uneven_inputs(value: str, owner: str = "EvenBatches") -> str:
    """Raises ValueError unless ``value`` is ``"truncate"`` or ``"error"``."""
    if value not in ("truncate", "error"):
        raise ValueError(
            f"{owner}'s uneven_inputs must be 'truncate' (every rank stops an epoch at the shortest rank's "
            f"batch count) or 'error' (refuse uneven batch counts), got {value!r}"
        )
    return value


def uneven_message(name: str, counts: list[str], stop: int, refuse: bool) -> str:
    """The warning, or with ``refuse`` the error, for per-rank ``counts`` (``"5"``, ``"more than 4"``)."""
    listed = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
    fix = "Give every rank the same number of batches (a DistributedSampler, or equal shards)"
    if refuse:
        return (
            f"the ranks have different numbers of {name} batches ({listed}). {fix}, or pass "
            "uneven_inputs='truncate' to stop every rank after the shortest count."
        )
    return (
        f"the ranks have different numbers of {name} batches ({listed}): every rank stops this epoch after "
        f"{stop} batches, the shortest count. {fix}, or pass uneven_inputs='error' to refuse this."
    )


def _length(loader: Iterable) -> int | None:
    try:
        return len(loader)  # type: ignore[arg-type]
    except (TypeError, NotImplementedError):
        return None


class EvenBatches:
    """``loader``'s batches, cut so that every rank of ``group`` yields the same number per epoch.

    A sized loader's counts are compared once per epoch; an iterable one agrees on each next batch, a batch
    ahead. Attributes are ``loader``'s; every rank iterates it at the same time.

    Args:
        loader: a ``DataLoader`` or any iterable of batches.
        group: the process group (default: the default group).
        uneven_inputs: ``"truncate"`` (stop at the shortest count, with a warning) or ``"error"``.
        name: what the batches are for, in the messages.
        on_uneven: called on every rank with the warning (default: ``warnings.warn`` on rank 0, once).

    Raises:
        UnevenInputsError: on every rank, when the counts differ and ``uneven_inputs="error"``.
    """

    def __init__(
        self,
        loader: Iterable,
        group: dist.ProcessGroup | None = None,
        uneven_inputs: str = "truncate",
        name: str = "training",
        on_uneven: Callable[[str], None] | None = None,
    ) -> None:
        self.loader, self.group, self.name = loader, group, name
        self.uneven = check_uneven_inputs(uneven_inputs)
        self._on_uneven = on_uneven or self._warn_once
        self._warned = False
        self._agreed: int | None = _length(loader)
        if self._agreed is not None and world_size(group) > 1:
            self._agreed = self._agree_on_length()

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (during unpickling)
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __len__(self) -> int:
        if self._agreed is None:
            raise TypeError(f"{type(self.loader).__name__} has no len(): its batch count is agreed per step")
        return self._agreed

    def __iter__(self) -> Iterator[Any]:
        if world_size(self.group) == 1:
            yield from self.loader
        elif _length(self.loader) is None:
            yield from self._agree_per_step()
        else:
            self._agreed = self._agree_on_length()
            # an IterableDataset's len() is a promise: agree per step too, up to it
            if isinstance(getattr(self.loader, "dataset", None), IterableDataset):
                yield from self._agree_per_step(self._agreed)
            else:
                yield from itertools.islice(self.loader, self._agreed)

    def _agree_on_length(self) -> int:
        """All_gather the counts; report a difference; the shortest count."""
        counts = self._gather(_length(self.loader))
        stop = min(counts)
        if len(set(counts)) > 1:
            self._report([str(c) for c in counts], stop)
        return stop

    def _agree_per_step(self, limit: int | None = None) -> Iterator[Any]:
        # The agreement on batch i + 1 runs while batch i trains.
        iterator = iter(self.loader) if limit is None else itertools.islice(self.loader, limit)
        yielded = 0
        device = torch.device("cpu")
        if dist.get_backend(self.group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())

        def fetch() -> tuple[Any, torch.Tensor, Any]:
            batch = next(iterator, _END)
            has_batch = torch.tensor([0 if batch is _END else 1], device=device)
            work = dist.all_reduce(has_batch, op=dist.ReduceOp.MIN, group=self.group, async_op=True)
            return batch, has_batch, work

        batch, has_batch, work = fetch()
        while True:
            work.wait()
            if not has_batch.item():
                break
            current = batch
            batch, has_batch, work = fetch()
            yielded += 1
            yield current
        cut = self._gather(0 if batch is _END else 1)  # which ranks still had a batch
        if any(cut):
            counts = [f"more than {yielded}" if c else str(yielded) for c in cut]
            self._report(counts, yielded)

    def _report(self, counts: list[str], stop: int) -> None:
        if self.uneven == "error":
            raise UnevenInputsError(uneven_message(self.name, counts, stop, refuse=True))
        self._on_uneven(uneven_message(self.name, counts, stop, refuse=False))

    def _warn_once(self, message: str) -> None:
        if not self._warned and dist.get_rank(self.group) == 0:
            warnings.warn(message, stacklevel=3)
        self._warned = True

    def _gather(self, value: int | None) -> list[int]:
        gathered: list[Any] = [None] * world_size(self.group)
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered


_END = object()
