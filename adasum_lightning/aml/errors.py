"""The errors of ``adasum-aml``, in a module of their own that every other module of the package imports."""

from __future__ import annotations

__all__ = ["AmlSubmitError", "AmlUsageError"]


class AmlUsageError(ValueError):
    """Bad input (arguments, config file, topology, VM size): the message names the fix. CLI exit code 2."""


class AmlSubmitError(RuntimeError):
    """Submission failed at run time (no network, authentication, Azure error). CLI exit code 1."""
