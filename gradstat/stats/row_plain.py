"""Plain numpy twins of :mod:`gradstat.stats.row_kernels`: the same contracts, the same
signatures, written as numpy's separate passes over a float32 row.

Each function here is the reference its compiled twin is tested against
(tests/test_row_kernels.py: ties, zeros of either sign, subnormals, NaN and Inf), and
what ``benchmarks/scale.py --plain`` runs in its place to measure what the compiled
loop buys end to end (docs/large.md, "Fast paths"). Float32 arithmetic is numpy's, in
the order written, so sums and candidates are bit for bit the compiled loops'; float64
sums of squares agree to rounding (the compiled loops may add them in another order).

:func:`compensated_add` is gradstat's one compensated (Kahan) sum: the compiled loops'
``kahan_step`` is its loop form, and the GPU path (torch tensors) uses it as written.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gradstat.stats.row_kernels import Found, Room, float32_limit


def compensated_add(s: Any, c: Any, x: Any) -> tuple[Any, Any]:
    """(s, c) after adding ``x`` to the compensated sum ``s`` with compensation ``c``
    (Kahan 1965): y = x - c, t = s + y, c' = (t - s) - y, s' = t; the sum is s - c.
    Elementwise on numpy arrays or torch tensors alike, in their dtype (float32)."""
    y = x - c
    t = s + y
    return t, (t - s) - y


def _squares(x: np.ndarray) -> float:
    """sum x^2 in float64 (each term exact)."""
    x64 = x.astype(np.float64)
    return float(np.dot(x64, x64))


def scan_row(
    x: np.ndarray,
    threshold: float | None,
    room: Room,
    total: np.ndarray | None = None,
    error: np.ndarray | None = None,
    first: bool = False,
) -> Found:
    """:func:`~gradstat.stats.row_kernels.scan_row`: candidates, finiteness and the
    compensated sum's update."""
    if total is not None and error is not None:
        if first:
            total[:], error[:] = x, 0
        else:
            total[:], error[:] = compensated_add(total, error, x)
    indices = indices_at_least(x, threshold)
    return Found(indices, np.abs(x[indices]), bool(np.isfinite(x).all()))


def mean_row(
    total: np.ndarray,
    error: np.ndarray,
    n: int,
    mean: np.ndarray,
    threshold: float | None,
    room: Room,
) -> tuple[np.ndarray, np.ndarray, float]:
    """:func:`~gradstat.stats.row_kernels.mean_row`: ``(total - error) / n`` into
    ``mean``, its candidates and float64 sum of squares."""
    np.divide(total - error, np.float32(n), out=mean)
    indices = indices_at_least(mean, threshold)
    return indices, np.abs(mean[indices]), _squares(mean)


def indices_at_least(x: np.ndarray, threshold: float | None, inclusive: bool = True) -> np.ndarray:
    """:func:`~gradstat.stats.row_kernels.indices_at_least` (None: no index)."""
    return np.flatnonzero(np.abs(x) >= float32_limit(threshold, inclusive))


def magnitudes_at_least(x: np.ndarray, threshold: float, inclusive: bool = True) -> np.ndarray:
    """:func:`~gradstat.stats.row_kernels.magnitudes_at_least`."""
    magnitudes = np.abs(x)
    return magnitudes[magnitudes >= float32_limit(threshold, inclusive)]


def count_at_least(x: np.ndarray, threshold: float, inclusive: bool = True) -> int:
    """:func:`~gradstat.stats.row_kernels.count_at_least`."""
    return int(np.count_nonzero(np.abs(x) >= float32_limit(threshold, inclusive)))


def magnitude_sums(x: np.ndarray) -> tuple[float, float, float, float, int]:
    """:func:`~gradstat.stats.row_kernels.magnitude_sums`: (sum x, sum |x|, sum x^2,
    max |x|, zeros), the sums in float64."""
    x64 = x.astype(np.float64)
    maximum = float(np.abs(x).max()) if x.size else 0.0
    zeros = x.size - int(np.count_nonzero(x))
    return float(x64.sum()), float(np.abs(x64).sum()), _squares(x), maximum, zeros


def count_nonzero(x: np.ndarray) -> int:
    """:func:`~gradstat.stats.row_kernels.count_nonzero`."""
    return int(np.count_nonzero(x))


def momentum_add(u: np.ndarray, v: np.ndarray, g: np.ndarray, momentum: float) -> tuple[int, float]:
    """:func:`~gradstat.stats.row_kernels.momentum_add`: ``u = momentum u + g``,
    ``v += u`` (float32), then v's zeros and float64 sum of squares."""
    u *= np.float32(momentum)
    u += g
    v += u
    return v.size - int(np.count_nonzero(v)), _squares(v)


def squared_norm(x: np.ndarray) -> float:
    """:func:`~gradstat.stats.row_kernels.squared_norm`."""
    return _squares(x)


def error_sums(estimate: np.ndarray, reference: np.ndarray) -> tuple[float, float, float, float]:
    """:func:`~gradstat.stats.row_kernels.error_sums`."""
    e, r = estimate.astype(np.float64), reference.astype(np.float64)
    d = e - r
    return float(np.dot(r, r)), float(np.dot(e, e)), float(np.dot(e, r)), float(np.dot(d, d))


def add_checked(x: np.ndarray, total: np.ndarray) -> bool:
    """:func:`~gradstat.stats.row_kernels.add_checked`: ``total += x``; whether x is
    finite."""
    total += x
    return bool(np.isfinite(x).all())
