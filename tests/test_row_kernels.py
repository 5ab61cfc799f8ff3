"""The compiled row loops (gradstat.stats.row_kernels) against numpy's separate passes:
the same compensated sum bit for bit, the same candidate indices, the same finiteness, and
float64 sums equal to numpy's float64 dot products."""

import numpy as np
import pytest
import torch

from gradstat.stats.row_kernels import (
    ROOM,
    Room,
    add_checked,
    count_at_least,
    error_sums,
    indices_at_least,
    loops,
    magnitude_sums,
    magnitudes_at_least,
    mean_row,
    momentum_add,
    scan_row,
    squared_norm,
)
from gradstat.stats.row_plain import compensated_add

#: Values per piece of the compiled loops: rows that cross pieces.
PIECE = loops().PIECE


def _kahan(s: np.ndarray, c: np.ndarray, x: np.ndarray) -> None:
    """Kahan's update as numpy's four passes, in place."""
    s[:], c[:] = compensated_add(s, c, x)


@pytest.mark.parametrize("numel", [1, 15, 17, PIECE - 1, PIECE + 33, 3 * PIECE + 5])
def test_sum_and_candidates_equal_numpy(numel):
    rng = np.random.default_rng(numel)
    rows = (rng.standard_normal((3, numel)) * np.exp(rng.standard_normal((3, numel)))).astype(
        np.float32
    )
    rows[0, :: max(1, numel // 7)] = -0.0
    total, error = np.empty(numel, np.float32), np.empty(numel, np.float32)
    s, c = rows[0].copy(), np.zeros(numel, np.float32)
    out = Room(1 << 12)
    for i, x in enumerate(rows):
        threshold = float(np.quantile(np.abs(x), 0.9))
        found, magnitudes, finite = scan_row(x, threshold, out, total, error, first=i == 0)
        if i:
            _kahan(s, c, x)
        assert finite
        np.testing.assert_array_equal(found, np.flatnonzero(np.abs(x) >= threshold))
        np.testing.assert_array_equal(magnitudes, np.abs(x[found]))
        assert total.tobytes() == s.tobytes() and error.tobytes() == c.tobytes()


@pytest.mark.parametrize("n", [1, 3, 16])
def test_mean_row_equals_torch_and_its_squares_float64(n):
    rng = np.random.default_rng(n)
    numel = 3 * PIECE + 5
    total = (rng.standard_normal(numel) * 10).astype(np.float32)
    error = (rng.standard_normal(numel) * 1e-6).astype(np.float32)
    mean = np.empty(numel, np.float32)
    threshold = float(np.quantile(np.abs(total), 0.99)) / n
    found, magnitudes, squares = mean_row(total, error, n, mean, threshold, Room(8))
    expected = torch.sub(torch.from_numpy(total), torch.from_numpy(error)).div_(n).numpy()
    assert mean.tobytes() == expected.tobytes()
    np.testing.assert_array_equal(found, np.flatnonzero(np.abs(expected) >= threshold))
    np.testing.assert_array_equal(magnitudes, np.abs(expected[found]))
    exact = float(np.dot(expected.astype(np.float64), expected.astype(np.float64)))
    assert squares == pytest.approx(exact, rel=1e-12)


def test_ties_at_the_threshold_are_kept_and_signs_ignored():
    x = np.array([0.5, -0.5, 0.25, -0.75, 0.4999999, 0.0, -0.0] * 5, dtype=np.float32)
    found, _, finite = scan_row(x, 0.5, Room(64))
    np.testing.assert_array_equal(found, np.flatnonzero(np.abs(x) >= 0.5))
    assert finite
    everything, _, _ = scan_row(x, 0.0, Room(64))
    np.testing.assert_array_equal(everything, np.arange(x.size))


def test_no_threshold_finds_nothing():
    x = np.full(100, np.finfo(np.float32).max, dtype=np.float32)
    found, _, finite = scan_row(x, None, Room(8))
    assert found.size == 0 and finite


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [0, 40, 99])
def test_nonfinite_values_are_reported(bad, where):
    x = np.ones(100, dtype=np.float32)
    x[where] = bad
    finite = scan_row(x, 2.0, Room(8)).finite
    assert not finite


def test_more_candidates_than_room_are_all_returned():
    rng = np.random.default_rng(1)
    x = rng.standard_normal(50_000).astype(np.float32)
    total, error = np.zeros_like(x), np.zeros_like(x)
    found, magnitudes, _ = scan_row(x, 0.1, Room(16), total, error)
    np.testing.assert_array_equal(found, np.flatnonzero(np.abs(x) >= 0.1))
    np.testing.assert_array_equal(magnitudes, np.abs(x[found]))
    np.testing.assert_array_equal(total, x)  # added once, not again by the second pass


def test_a_first_row_makes_the_sum_and_clears_the_compensation():
    x = np.arange(40, dtype=np.float32)
    total, error = np.full(40, 3.0, dtype=np.float32), np.full(40, 7.0, dtype=np.float32)
    scan_row(x, None, Room(1), total, error, first=True)
    np.testing.assert_array_equal(total, np.arange(40))
    assert not error.any()


def _awkward_row() -> np.ndarray:
    rng = np.random.default_rng(7)
    x = rng.standard_normal(5 * PIECE + 3).astype(np.float32)
    x[::97] = 0.0
    x[1::101] = -0.0
    x[5] = np.inf
    x[6] = -np.inf
    x[7] = np.nan
    x[8:12] = np.float32(0.5)
    return x


@pytest.mark.parametrize("threshold", [0.5, 1.0 / 3.0, 2.0, 0.0, -0.0, -1.0, np.inf, np.nan])
@pytest.mark.parametrize("inclusive", [True, False])
def test_indices_at_least_equals_numpy(threshold, inclusive):
    x = _awkward_row()
    magnitudes = np.abs(x)
    with np.errstate(invalid="ignore"):
        expected = np.flatnonzero(magnitudes >= threshold if inclusive else magnitudes > threshold)
    np.testing.assert_array_equal(indices_at_least(x, threshold, inclusive), expected)


def test_indices_at_least_past_its_room():
    x = np.random.default_rng(3).standard_normal(ROOM * 3).astype(np.float32)
    np.testing.assert_array_equal(indices_at_least(x, 0.1), np.flatnonzero(np.abs(x) >= 0.1))


def test_float64_sums_equal_numpy():
    rng = np.random.default_rng(11)
    e = (rng.standard_normal(PIECE + 7) * 1e3).astype(np.float32)
    r = (e + rng.standard_normal(e.size)).astype(np.float32)
    e64, r64 = e.astype(np.float64), r.astype(np.float64)
    assert squared_norm(e) == pytest.approx(float(e64 @ e64), rel=1e-12)
    expected = (r64 @ r64, e64 @ e64, e64 @ r64, (e64 - r64) @ (e64 - r64))
    assert error_sums(e, r) == pytest.approx(expected, rel=1e-12)


def test_add_checked_adds_in_float32_and_reports_nonfinite():
    rng = np.random.default_rng(5)
    x = rng.standard_normal(1001).astype(np.float32)
    total = rng.standard_normal(1001).astype(np.float32)
    expected = total + x
    assert add_checked(x, total)
    assert total.tobytes() == expected.tobytes()
    x[500] = np.nan
    assert not add_checked(x, total)


def test_momentum_add_equals_torch_bit_for_bit():
    """DGC's ``u = m u + g; v = v + u`` in one loop: the product is rounded before the add
    (no fused multiply-add), as torch's ``mul_`` then ``add_``; values that straddle
    rounding boundaries would show a fused add."""
    rng = np.random.default_rng(11)
    u, v, g = (rng.standard_normal((3, PIECE + 99)) * 1e4).astype(np.float32)
    g[::2] = -u[::2] * np.float32(0.9)  # cancellation: a fused add keeps the product's tail
    expected_u, expected_v = torch.from_numpy(u.copy()), torch.from_numpy(v.copy())
    expected_u.mul_(0.9).add_(torch.from_numpy(g))
    expected_v.add_(expected_u)
    momentum_add(u, v, g, 0.9)
    assert u.tobytes() == expected_u.numpy().tobytes()
    assert v.tobytes() == expected_v.numpy().tobytes()


def _edge_row(size: int = 3 * PIECE + 17, seed: int = 7) -> np.ndarray:
    """Normal values with ties at 1.0, exact zeros of both signs, subnormals and +-Inf."""
    x = np.random.default_rng(seed).standard_normal(size).astype(np.float32)
    x[::97] = 1.0
    x[5::101] = -1.0
    x[7::89] = 0.0
    x[9::89] = -0.0
    x[11::211] = np.float32(1e-40)  # subnormal
    x[13] = np.inf
    x[15] = -np.inf
    return x


@pytest.mark.parametrize("threshold", [0.0, 1e-40, 1.0, 2.5, float("inf")])
@pytest.mark.parametrize("inclusive", [True, False])
def test_counts_and_magnitudes_at_least_equal_numpys(threshold, inclusive):
    x = _edge_row()
    passing = np.abs(x) >= threshold if inclusive else np.abs(x) > threshold
    assert count_at_least(x, threshold, inclusive) == int(passing.sum())
    np.testing.assert_array_equal(magnitudes_at_least(x, threshold, inclusive), np.abs(x)[passing])


def test_magnitude_sums_equal_numpys_float64_sums():
    x = _edge_row()
    x[13] = x[15] = 3.0  # finite: the sums are numbers
    signed, total, squares, maximum, zeros = magnitude_sums(x)
    wide = x.astype(np.float64)
    assert signed == pytest.approx(wide.sum(), rel=1e-12)
    assert total == pytest.approx(np.abs(wide).sum(), rel=1e-12)
    assert squares == pytest.approx((wide * wide).sum(), rel=1e-12)
    assert maximum == float(np.abs(x).max()) and zeros == int((x == 0).sum())
    x[3] = np.nan
    assert np.isnan(magnitude_sums(x)[0])
