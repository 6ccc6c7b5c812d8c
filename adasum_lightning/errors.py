"""The error of a configuration a strategy refuses (Lightning-free; every rule raises it)."""

from __future__ import annotations

__all__ = ["AdasumConfigurationError"]


class AdasumConfigurationError(ValueError):
    """A configuration the strategy cannot run correctly; the message names the fix.

    A ``ValueError``, not Lightning's ``MisconfigurationException``: one class under either Lightning package.
    """
