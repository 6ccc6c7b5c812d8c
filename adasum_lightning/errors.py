"""The error of a configuration a strategy refuses, and how every rank reports it (Lightning-free)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

__all__ = ["AdasumConfigurationError", "reported_on_every_rank"]


class AdasumConfigurationError(ValueError):
    """A configuration the strategy cannot run correctly; the message names the fix."""


@contextlib.contextmanager
def reported_on_every_rank(rank: int) -> Iterator[None]:
    """Print a refused configuration on this rank at once (the launcher may kill it soon), then re-raise."""
    try:
        yield
    except AdasumConfigurationError as err:
        print(f"AdasumConfigurationError on rank {rank}: {err}", file=sys.stderr, flush=True)
        raise
