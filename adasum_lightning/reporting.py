"""How the strategies report a failure on every rank: a refused configuration, an unreadable checkpoint."""

from __future__ import annotations

import contextlib
import pickle
import sys
from collections.abc import Iterator

from adasum_lightning.validation import AdasumConfigurationError

__all__ = ["CHECKPOINT_READ_ERRORS", "reported_on_every_rank"]

#: What ``torch.load`` raises for a file it cannot read; a corrupt pickle stream can also fail in a memo
#: lookup (``KeyError``, ``IndexError``). :func:`adasum_lightning.validation.unreadable_checkpoint` words it.
CHECKPOINT_READ_ERRORS = (
    pickle.UnpicklingError,
    EOFError,
    RuntimeError,
    ValueError,
    OSError,
    KeyError,
    IndexError,
)


@contextlib.contextmanager
def reported_on_every_rank(rank: int) -> Iterator[None]:
    """Print a refused configuration on this rank at once, then re-raise it.

    Once the first rank exits, the launcher kills the others, which could die before printing their traceback.
    """
    try:
        yield
    except AdasumConfigurationError as err:
        print(f"AdasumConfigurationError on rank {rank}: {err}", file=sys.stderr, flush=True)
        raise
