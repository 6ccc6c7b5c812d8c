"""The reference Adasum operator in pure PyTorch: the arithmetic of Horovod's MPI Adasum allreduce.

Tests check the collectives against it, and the simulator uses it without processes. Sources: Maleki et al.,
"Scaling Distributed Training with Adaptive Summation", MLSys 2021 (the operator); Horovod 0.28.1
``horovod/common/ops/adasum/adasum.h`` (float64 accumulation, the ``sqrt(DBL_MIN)`` guard, the pairing).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import torch

__all__ = ["adasum", "adasum_reduce", "is_power_of_two", "nearest_powers_of_two", "ADASUM_NORM_EPS"]

#: Squared norms below this count as zero (coefficient 1, so a zero update gives no NaN): Horovod's
#: ``std::sqrt(DBL_MIN)`` ≈ 1.49e-154.
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
    """Adasum of two tensors of the same shape: ``(1 - a·b / (2‖a‖²))·a + (1 - a·b / (2‖b‖²))·b``.

    Orthogonal inputs give ``a + b``, identical ones ``a``. One coefficient pair per tensor, from float64 dot
    products; a coefficient is 1 when its squared norm is below :data:`ADASUM_NORM_EPS`.

    Args:
        a, b: tensors of one shape, floating dtype (float16, bfloat16, float32 or float64), one device.

    Returns:
        A tensor of ``a``'s shape and dtype.

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
    """Adasum over ``N ≥ 1`` workers' tensors, in the order of the distributed allreduces.

    For ``N = 2**k``, Horovod's order: neighbours first, ``adasum(adasum(x0, x1), adasum(x2, x3))`` for four.
    Otherwise (Horovod refuses it; :func:`adasum_lightning.allreduce.adasum_allreduce` defines it), with ``P``
    the largest power of 2 ≤ ``N``, every ``x[r]`` with ``r ≥ P`` is first folded into ``x[r - P]``; three
    ranks give ``adasum(adasum(x0, x2), x1)``.

    Args:
        tensors: one tensor per rank, in rank order; all of one shape and floating dtype.

    Returns:
        The reduced tensor (shape and dtype of the inputs).

    Raises:
        ValueError: no tensor is given (or from :func:`adasum`).
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
