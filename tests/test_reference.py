"""The reference Adasum operator (adasum_lightning.reference) on values worked out by hand."""

import pytest
import torch

from adasum_lightning.reference import (
    ADASUM_NORM_EPS,
    adasum,
    adasum_reduce,
    is_power_of_two,
    nearest_powers_of_two,
)


def test_two_vectors_match_the_worked_example():
    a = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    b = torch.tensor([4.0, -1.0, 0.0, 2.0], dtype=torch.float64)
    # a·b = 10, ‖a‖² = 30, ‖b‖² = 21 → (1 - 10/60)·a + (1 - 10/42)·b
    expected = (1 - 10 / 60) * a + (1 - 10 / 42) * b
    assert torch.allclose(adasum(a, b), expected, rtol=0, atol=1e-15)
    assert torch.allclose(
        adasum(a, b), torch.tensor([3.880952, 0.904762, 2.5, 4.857143], dtype=torch.float64), atol=1e-6
    )


def test_orthogonal_inputs_add_and_identical_inputs_stay():
    a = torch.tensor([[3.0, 0.0], [0.0, 0.0]])
    b = torch.tensor([[0.0, 0.0], [0.0, -2.0]])
    assert torch.equal(adasum(a, b), a + b)
    c = torch.tensor([0.5, -1.5, 2.0])
    assert torch.equal(adasum(c, c), c)


def test_zero_update_gives_the_other_without_nan():
    b = torch.tensor([1.0, -2.0, 3.0])
    z = torch.zeros(3)
    assert torch.equal(adasum(z, b), b)
    assert torch.equal(adasum(b, z), b)
    assert torch.equal(adasum(z, z), z)
    tiny = torch.full((3,), 1e-160, dtype=torch.float64)  # squared norm below sqrt(DBL_MIN)
    assert (tiny @ tiny).item() < ADASUM_NORM_EPS
    assert torch.equal(adasum(tiny, b.double()), tiny + b.double())


def test_keeps_shape_and_dtype():
    a = torch.randn(3, 4, dtype=torch.float32)
    b = torch.randn(3, 4, dtype=torch.float32)
    out = adasum(a, b)
    assert out.shape == (3, 4) and out.dtype == torch.float32


def test_reduce_pairs_neighbours_first_like_horovod():
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(10, generator=gen, dtype=torch.float64) for _ in range(4)]
    assert torch.equal(adasum_reduce(xs), adasum(adasum(xs[0], xs[1]), adasum(xs[2], xs[3])))
    # …which differs from pairing 0 with 2 first: the order is part of the definition.
    assert not torch.allclose(adasum_reduce(xs), adasum(adasum(xs[0], xs[2]), adasum(xs[1], xs[3])))
    assert torch.equal(adasum_reduce(xs[:1]), xs[0])


def test_reduce_non_power_of_two_folds_the_extra_ranks_first():
    gen = torch.Generator().manual_seed(5)
    x = [torch.randn(10, generator=gen, dtype=torch.float64) for _ in range(12)]
    # P = largest power of 2 ≤ N; x[r - P] := adasum(x[r - P], x[r]) for r ≥ P, then Horovod's pairing
    assert torch.equal(adasum_reduce(x[:3]), adasum(adasum(x[0], x[2]), x[1]))
    assert torch.equal(adasum_reduce(x[:5]), adasum(adasum(adasum(x[0], x[4]), x[1]), adasum(x[2], x[3])))
    assert torch.equal(
        adasum_reduce(x[:6]), adasum(adasum(adasum(x[0], x[4]), adasum(x[1], x[5])), adasum(x[2], x[3]))
    )
    assert torch.equal(
        adasum_reduce(x[:7]),
        adasum(adasum(adasum(x[0], x[4]), adasum(x[1], x[5])), adasum(adasum(x[2], x[6]), x[3])),
    )
    folded = [adasum(x[r], x[r + 8]) for r in range(4)] + x[4:8]
    assert torch.equal(adasum_reduce(x[:12]), adasum_reduce(folded))
    # the fold is not a reordering of the power-of-2 tree: N = 3 differs from pairing 0 with 1 first
    assert not torch.allclose(adasum_reduce(x[:3]), adasum(adasum(x[0], x[1]), x[2]))


def test_reduce_needs_a_tensor():
    with pytest.raises(ValueError, match="at least one"):
        adasum_reduce([])


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="one shape"):
        adasum(torch.ones(2), torch.ones(3))
    with pytest.raises(ValueError, match="floating-point"):
        adasum(torch.ones(2, dtype=torch.int64), torch.ones(2, dtype=torch.int64))


def test_is_power_of_two():
    assert [n for n in range(0, 70) if is_power_of_two(n)] == [1, 2, 4, 8, 16, 32, 64]


def test_nearest_powers_of_two():
    assert [nearest_powers_of_two(n) for n in (1, 2, 3, 5, 8, 12, 33)] == [
        [1],
        [2],
        [2, 4],
        [4, 8],
        [8],
        [8, 16],
        [32, 64],
    ]
