"""The errors of ``adasum-aml`` and its one way of talking to the user."""

from __future__ import annotations

__all__ = ["AmlSubmitError", "AmlUsageError", "say"]


class AmlUsageError(ValueError):
    """Bad input (arguments, config file, topology, VM size): the message names the fix. CLI exit code 2."""


class AmlSubmitError(RuntimeError):
    """Submission failed at run time (no network, authentication, Azure error). CLI exit code 1."""


def say(message: str, file=None) -> None:
    """Print ``[adasum-aml] message`` to ``file`` (default stdout), flushed before the next slow step."""
    print(f"[adasum-aml] {message}", file=file, flush=True)
