"""The reference Adasum operator in pure PyTorch: the arithmetic of Horovod's MPI Adasum allreduce.

Sources: Maleki et al., "Scaling Distributed Training with Adaptive Summation", MLSys 2021; Horovod 0.28.1
``horovod/common/ops/adasum/adasum.h`` (float64 accumulation, the ``sqrt(DBL_MIN)`` guard, the pairing).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import torch

__all__ = ["adasum", "adasum_reduce", "is_power_of_two", "nearest_powers_of_two", "ADASUM_NORM_EPS"]

#: Squared norms below this count as zero (coefficient 1): Horovod's ``std::sqrt(DBL_MIN)``.
ADASUM_NORM_EPS: float = math.sqrt(sys.float_info.min)


def is_power_of_two(n: int) -> bool:
    """True for 1, 2, 4, 8, …; False for 0, negatives and anything not an ``int`` (``bool`` included)."""
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1 and (n & (n - 1)) == 0


def nearest_powers_of_two(n: int) -> list[int]:
    """The powers of 2 just below and just above ``n`` (one value when ``n`` < 2 or a power of 2)."""
    if n < 1:
        return [1]
    lower = 1 << (n.bit_length() - 1)
    return [lower] if lower == n else [lower, lower * 2]


def adasum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Adasum of two tensors of one shape: ``(1 - a·b / (2‖a‖²))·a + (1 - a·b / (2‖b‖²))·b`` (``a``'s dtype).

    Dot products in float64; a coefficient is 1 when its squared norm is below :data:`ADASUM_NORM_EPS`.

    Raises:
        ValueError: the shapes differ or a dtype is not floating point.
    """
    if a.shape != b.shape:
        raise ValueError(f"adasum needs tensors of one shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    if not a.is_floating_point() or not b.is_floating_point():
        raise ValueError(f"adasum needs floating-point tensors, got {a.dtype} and {b.dtype}")
    a64 = a.detach().to(torch.float64).reshape(-1)
    b64 = b.detach().to(torch.float64).reshape(-1)
    dot = torch.dot(a64, b64).item()
    a_sq = torch.dot(a64, a64).item()
    b_sq = torch.dot(b64, b64).item()
    a_coeff = 1.0 - dot / a_sq * 0.5 if a_sq >= ADASUM_NORM_EPS else 1.0
    b_coeff = 1.0 - dot / b_sq * 0.5 if b_sq >= ADASUM_NORM_EPS else 1.0
    return (a_coeff * a64 + b_coeff * b64).reshape(a.shape).to(a.dtype)


def adasum_reduce(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Adasum over the ranks' ``tensors`` in the allreduce's order; ValueError for none.

    Neighbours first (``adasum(adasum(x0, x1), adasum(x2, x3))``); with ``P`` the largest power of 2 ≤ ``N``,
    ``x[r]`` for ``r ≥ P`` is first folded into ``x[r - P]`` (three give ``adasum(adasum(x0, x2), x1)``).
    """
    items = list(tensors)
    if not items:
        raise ValueError("adasum_reduce needs at least one tensor, got none")
    p = 1 << (len(items).bit_length() - 1)  # largest power of 2 <= len(items)
    for r in range(p, len(items)):
        items[r - p] = adasum(items[r - p], items[r])
    items = items[:p]
    while len(items) > 1:
        items = [adasum(items[i], items[i + 1]) for i in range(0, len(items), 2)]
    return items[0]
