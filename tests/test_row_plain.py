"""Every compiled row loop (gradstat.stats.row_kernels) against its plain numpy twin
(gradstat.stats.row_plain) on rows with the edge cases: ties at the threshold, zeros of
either sign, subnormals, values at the float32 extremes, NaN and Inf. Arrays and counts
are compared bit for bit, float64 sums to rounding."""

import math

import numpy as np
import pytest

from gradstat.stats import row_kernels as fast
from gradstat.stats import row_plain as plain

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # overflow to Inf

#: The compiled loops' piece and block: rows that cross both.
BLOCK, PIECE = fast.loops().BLOCK, fast.loops().PIECE
TIE = np.float32(1.5)
TINY = np.float32(1e-40)  # subnormal
NUMEL = PIECE + 3 * BLOCK + 5  # crosses a piece and leaves a tail of a block


def _row(seed: int, bad: float | None = None) -> np.ndarray:
    """A heavy-tailed float32 row with ties at ``TIE``, +-0, subnormals and extremes;
    ``bad``: a NaN or Inf put in it."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(NUMEL) * np.exp(rng.standard_normal(NUMEL))).astype(np.float32)
    x[::97], x[5::97] = TIE, -TIE
    x[1::89], x[2::89] = 0.0, -0.0
    x[3::83], x[4::83] = TINY, -np.float32(1e-45)
    x[7], x[8] = np.finfo(np.float32).max, -np.finfo(np.float32).max
    if bad is not None:
        x[NUMEL // 2] = bad
    return x


def _same_sum(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-12, abs=1e-30)


THRESHOLDS = [float(TIE), 0.0, float(TINY), 2.5, None, math.nan, math.inf]


@pytest.mark.parametrize("bad", [None, math.nan, math.inf])
@pytest.mark.parametrize("threshold", THRESHOLDS)
@pytest.mark.parametrize("first", [True, False])
def test_scan_row_equals_its_plain_twin(bad, threshold, first):
    x = _row(1, bad)
    results = []
    for module in (fast, plain):
        total, error = _row(2), np.full(NUMEL, TINY, np.float32)
        found = module.scan_row(x, threshold, fast.Room(64), total, error, first)
        results.append((found, total, error))
    (f, ft, fe), (p, pt, pe) = results
    np.testing.assert_array_equal(f.indices, p.indices)
    np.testing.assert_array_equal(f.magnitudes, p.magnitudes)
    assert f.finite == p.finite == (bad is None)
    assert ft.tobytes() == pt.tobytes() and fe.tobytes() == pe.tobytes()


@pytest.mark.parametrize("threshold", THRESHOLDS)
def test_mean_row_equals_its_plain_twin(threshold):
    total, error = _row(6), _row(7) * np.float32(1e-7)
    (fi, fm, fs), (pi, pm, ps) = (
        module.mean_row(total, error, 3, mean, threshold, fast.Room(16))
        for module, mean in (
            (fast, np.empty(NUMEL, np.float32)),
            (plain, np.empty(NUMEL, np.float32)),
        )
    )
    np.testing.assert_array_equal(fi, pi)
    np.testing.assert_array_equal(fm, pm)
    assert _same_sum(fs, ps)


@pytest.mark.parametrize("inclusive", [True, False])
@pytest.mark.parametrize("threshold", [t for t in THRESHOLDS if t is not None])
def test_selections_equal_their_plain_twins(threshold, inclusive):
    x = _row(8, math.nan)
    for name in ("indices_at_least", "magnitudes_at_least"):
        np.testing.assert_array_equal(
            getattr(fast, name)(x, threshold, inclusive),
            getattr(plain, name)(x, threshold, inclusive),
        )
    assert fast.count_at_least(x, threshold, inclusive) == plain.count_at_least(
        x, threshold, inclusive
    )


@pytest.mark.parametrize("bad", [None, math.nan, math.inf, -math.inf])
def test_sums_equal_their_plain_twins(bad):
    x, r = _row(9, bad), _row(10)
    x[9] = r[9] = 1e30  # squares past float32, within float64
    for f, p in zip(fast.magnitude_sums(x), plain.magnitude_sums(x), strict=True):
        assert _same_sum(f, p) or (bad is not None and math.isnan(f) and math.isnan(p))
    assert fast.count_nonzero(x) == plain.count_nonzero(x)
    assert _same_sum(fast.squared_norm(x), plain.squared_norm(x))
    for f, p in zip(fast.error_sums(x, r), plain.error_sums(x, r), strict=True):
        assert _same_sum(f, p)


@pytest.mark.parametrize("bad", [None, math.nan])
def test_updates_in_place_equal_their_plain_twins(bad):
    g = _row(11, bad)
    runs = []
    for module in (fast, plain):
        u, v, total = _row(12), _row(13), _row(15)
        momentum = module.momentum_add(u, v, g, 0.9)
        finite = module.add_checked(g, total)
        runs.append((u, v, total, momentum, finite))
    f, p = runs
    for one, other in zip(f[:3], p[:3], strict=True):
        assert one.tobytes() == other.tobytes()
    assert f[3][0] == p[3][0] and _same_sum(f[3][1], p[3][1])
    assert f[4] == p[4] == (bad is None)


def test_compensated_add_is_kahans_update_on_numpy_and_torch():
    import torch

    s, c, x = (
        np.array([1e8, 1.0, -0.0], np.float32),
        np.zeros(3, np.float32),
        np.array([1.0, 1e-8, 0.0], np.float32),
    )
    t, e = plain.compensated_add(s, c, x)
    assert t[0] == np.float32(1e8) and e[0] == np.float32(-1.0)  # 1 lost, kept in c
    ts, es = plain.compensated_add(*(torch.from_numpy(a) for a in (s, c, x)))
    assert ts.numpy().tobytes() == t.tobytes() and es.numpy().tobytes() == e.tobytes()


def test_the_running_sums_torch_form_equals_the_compiled_loops():
    import torch

    from gradstat.stats.rows import CompensatedSum

    sums = CompensatedSum(NUMEL, torch.device("cpu"))
    total, error = np.empty(NUMEL, np.float32), np.empty(NUMEL, np.float32)
    for i in range(3):
        x = _row(20 + i)
        sums.add(torch.from_numpy(x), first=i == 0)
        fast.scan_row(x, None, fast.Room(1), total, error, first=i == 0)
    assert sums.total.numpy().tobytes() == total.tobytes()
    assert sums.error.numpy().tobytes() == error.tobytes()
    mean = np.empty(NUMEL, np.float32)
    fast.mean_row(total, error, 3, mean, None, fast.Room(1))
    assert sums.mean(3, out=torch.empty(NUMEL)).numpy().tobytes() == mean.tobytes()
