"""How the strategies report a refused configuration on every rank."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from adasum_lightning.errors import AdasumConfigurationError

__all__ = ["reported_on_every_rank"]


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
