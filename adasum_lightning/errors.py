"""The error of a configuration a strategy refuses, and how every rank reports it (Lightning-free)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

__all__ = ["AdasumConfigurationError", "reported_on_every_rank"]


class AdasumConfigurationError(ValueError):
    """A configuration the strategy cannot run correctly; the message names the fix.

    A ``ValueError``, not Lightning's ``MisconfigurationException``: one class under either Lightning package.
    """


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
