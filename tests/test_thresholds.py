"""Threshold estimators against exact top-k and brute-force re-implementations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from gradstat.errors import DataError, UsageError
from gradstat.stats.density import k_for
from gradstat.stats.passes import COMPILED_MIN_NUMEL, RowPasses, compress
from gradstat.stats.sidco import AdaptiveStages, stage_densities
from gradstat.stats.thresholds import ESTIMATORS, estimate_threshold

N = 2_000_000


def _signed(magnitudes: np.ndarray, seed: int = 1) -> torch.Tensor:
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], size=magnitudes.size)
    return torch.from_numpy((magnitudes * signs).astype(np.float32))


@pytest.fixture(scope="module")
def samples() -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(0)
    return {
        "exp": _signed(stats.expon(scale=0.01).rvs(N, random_state=rng)),
        "gpd": _signed(stats.genpareto(c=0.3, scale=0.01).rvs(N, random_state=rng)),
        "gamma": _signed(stats.gamma(a=0.6, scale=0.02).rvs(N, random_state=rng)),
        "normal": torch.from_numpy(stats.norm(0.0, 0.01).rvs(N, random_state=rng)).float(),
    }


def _kth_largest(values: torch.Tensor, k: int) -> float:
    return float(np.sort(np.abs(values.numpy()))[-k])


def _chosen(result, values: torch.Tensor) -> torch.Tensor:
    """The elements of ``values`` a result selects, by a plain compare of |values|."""
    x = values.abs()
    return x >= result.threshold if result.inclusive else x > result.threshold


@pytest.mark.parametrize(
    ("estimator", "data"),
    [("sidco-exp", "exp"), ("sidco-gpd", "gpd"), ("sidco-gamma-gpd", "gamma")],
)
@pytest.mark.parametrize("ratio", [0.01, 0.001])
@pytest.mark.parametrize("stages", [1, 3])
def test_sidco_matches_topk_on_its_own_distribution(samples, estimator, data, ratio, stages):
    values = samples[data]
    result = estimate_threshold(values, ratio, estimator, stages=stages)
    k = k_for(ratio, N)
    assert result.k == k
    assert result.stages == stages
    # SIDCo's closed-form gamma shape is ~1.3% low at a = 0.6 (vs the MLE root): at 1e-3
    # a single gamma stage then selects ~9% too few.
    tolerance = 0.12 if (estimator, stages) == ("sidco-gamma-gpd", 1) else 0.08
    assert result.quality == pytest.approx(1.0, abs=tolerance)
    assert result.threshold == pytest.approx(_kth_largest(values, k), rel=0.05)
    assert result.selected == int((values.abs() > result.threshold).sum())


def _brute_sidco(x: np.ndarray, density: float, stages: int, first: str, later: str):
    """SIDCo's stages in float64 numpy, straight from docs/methods.md 1 and 2."""

    def quantile(kind: str, v: np.ndarray, d: float) -> float:
        m = v.mean()
        if kind == "exp":
            return -m * math.log(d)
        if kind == "gpd":
            r = m * m / v.var()
            xi, sigma = (1 - r) / 2, m * (r + 1) / 2
            return sigma / xi * (d**-xi - 1)
        s = math.log(m) - np.log(v).mean()
        alpha = (3 - s + math.sqrt((s - 3) ** 2 + 24 * s)) / (12 * s)
        return m / alpha * stats.gamma(alpha).isf(d)

    per = (density / 0.25) ** (1 / (stages - 1))
    eta = quantile(first, x, 0.25)
    etas = [eta]
    for _ in range(stages - 1):
        y = x[x > eta]
        eta = y.min() + quantile(later, y - y.min(), per)
        etas.append(eta)
        x = y
    return etas, int((x > eta).sum())


@pytest.mark.parametrize(
    ("estimator", "first", "later"),
    [("sidco-exp", "exp", "exp"), ("sidco-gpd", "gpd", "gpd"), ("sidco-gamma-gpd", "gamma", "gpd")],
)
def test_sidco_follows_the_multi_stage_rule(samples, estimator, first, later):
    values = samples["gpd"]
    x = np.abs(values.numpy()).astype(np.float64)
    k = k_for(0.001, N)
    expected, selected = _brute_sidco(x, k / N, 4, first, later)
    result = estimate_threshold(values, 0.001, estimator, stages=4)
    assert result.stages == 4
    assert result.densities[0] == 0.25
    assert math.prod(result.densities) == pytest.approx(k / N, rel=1e-12)
    np.testing.assert_allclose(result.stage_thresholds, expected, rtol=1e-4)
    assert abs(result.selected - selected) <= max(2, selected // 1000)


def test_stage_densities_multiply_to_the_target():
    for density in (0.1, 0.01, 1e-4):
        for stages in (1, 2, 3, 5):
            d = stage_densities(density, stages)
            assert len(d) == stages
            assert math.prod(d) == pytest.approx(density, rel=1e-12)
    assert stage_densities(0.3, 3) == (0.3,)


def test_one_stage_is_far_off_on_heavy_tails_and_stages_fix_it(samples):
    # docs/methods.md 2: on heavy tails one exponential stage selects far too many at 1e-3.
    one = estimate_threshold(samples["gpd"], 0.001, "sidco-exp", stages=1)
    three = estimate_threshold(samples["gpd"], 0.001, "sidco-exp", stages=3)
    assert one.quality > 2.0
    assert abs(math.log(three.quality)) < abs(math.log(one.quality)) / 3


def test_shared_passes_give_the_same_thresholds_as_fresh_calls(samples):
    # fit runs every estimator at several densities and stage counts on one row with one
    # RowPasses, whose counts run on kept exceedance pools: each result must equal a call
    # that scans the row itself, and each count must equal a brute-force count.
    values = samples["gpd"][:300_000].clone()
    values[::7] = 0.0  # zeros: include and exclude use different stage-1 moments
    shared = RowPasses(values)
    calls = [
        (estimator, ratio, stages, zeros)
        for estimator in (*ESTIMATORS, "hard")
        for zeros in ("exclude", "include")
        for ratio in (0.01, 0.001)
        for stages in (1, 2, 3)
    ]
    magnitudes = values.abs()
    for estimator, ratio, stages, zeros in calls:
        options = {"stages": stages, "zeros": zeros, "threshold": 0.5}
        generator = torch.Generator().manual_seed(5)  # DGC's sample: the same for both
        kept = estimate_threshold(
            values, ratio, estimator, shared=shared, generator=generator, **options
        )
        generator = torch.Generator().manual_seed(5)
        fresh = estimate_threshold(values, ratio, estimator, generator=generator, **options)
        assert kept == fresh, (estimator, ratio, stages, zeros)
        passing = magnitudes >= kept.threshold if kept.inclusive else magnitudes > kept.threshold
        if estimator not in ("topk", "dgc"):  # these two report k after an exact top-k
            assert kept.selected == int(passing.sum()), (estimator, ratio, stages, zeros)


@pytest.mark.parametrize("form", ["compiled", "float32", "float64", "strided"])
def test_row_passes_count_and_exceed_equal_brute_force_at_every_threshold(form):
    # pools are reused for every later question: counts and exceedances (in the row's
    # order) must equal a full scan at thresholds below, at and above earlier ones,
    # strict and inclusive, zero and negative thresholds included; a contiguous float32
    # row and its pools are scanned by the compiled loops when asked ("compiled"), other
    # rows through their |x|.
    rng = np.random.default_rng(3)
    values = torch.from_numpy(rng.standard_t(2, 400_000).astype(np.float32))
    values = values[::2] if form == "strided" else values[:200_000]
    values = values.double() if form == "float64" else values
    values[::5] = 0.0
    passes = RowPasses(values, compiled=form == "compiled")
    assert passes.nonzeros == int(torch.count_nonzero(values))
    magnitudes = values.abs()
    thresholds = [1.0, 3.0, 2.0, 3.0, 10.0, 0.5, 0.0, -1.0, float(magnitudes[11]), 50.0]
    for t in thresholds:
        for inclusive in (False, True):
            passing = magnitudes >= t if inclusive else magnitudes > t
            assert passes.count(t, inclusive) == int(passing.sum()), (t, inclusive)
            assert torch.equal(passes.exceed(t, inclusive), magnitudes[passing]), (t, inclusive)


def test_exceedance_sums_equal_sums_of_the_exceedances():
    # kept per level for the later SIDCo stages: count, float32 sums and minimum of the
    # magnitudes above the level (numpy in float64 as the reference), also after other
    # levels were asked for, and NaN as the minimum of an empty set
    rng = np.random.default_rng(5)
    values = torch.from_numpy(rng.standard_t(3, 300_000).astype(np.float32))
    values[::7] = 0.0
    passes = RowPasses(values)
    magnitudes = np.abs(values.numpy()).astype(np.float64)
    for t, inclusive in [(1.0, False), (2.5, True), (1.0, False), (0.5, False), (1e9, False)]:
        above = magnitudes[magnitudes >= t] if inclusive else magnitudes[magnitudes > t]
        sums = passes.exceedance_sums(t, inclusive)
        assert sums.n == above.size
        assert sums.total == pytest.approx(above.sum(), rel=1e-5)
        assert sums.squares == pytest.approx((above**2).sum(), rel=1e-5)
        if above.size:
            assert sums.minimum == above.min()
        else:
            assert math.isnan(sums.minimum)


def test_row_sums_equal_float64_sums():
    # a short row's sums: torch's float32 sums per chunk, float64 across chunks, equal to
    # the float64 sums of the same values to float32 rounding, over more than one chunk
    rng = np.random.default_rng(6)
    values = torch.from_numpy(rng.standard_t(3, 1_700_001).astype(np.float32))
    values[::9] = 0.0
    sums = RowPasses(values).sums(log=True)
    signed = values.numpy().astype(np.float64)
    x = np.abs(signed[signed != 0])
    assert (sums.numel, sums.nonzeros) == (values.numel(), x.size)
    assert sums.signed_total == pytest.approx(signed.sum(), rel=1e-6, abs=1e-3)
    assert sums.total == pytest.approx(x.sum(), rel=1e-6)
    assert sums.squares == pytest.approx((x**2).sum(), rel=1e-6)
    assert sums.log_sum == pytest.approx(np.log(x).sum(), rel=1e-5)
    assert sums.maximum == x.max()


def test_zeros_are_excluded_from_the_density(samples):
    exp = samples["exp"].clone()
    exp[::2] = 0.0  # half the coordinates are exact zeros
    result = estimate_threshold(exp, 0.001, "sidco-exp", stages=1)
    nonzero = exp[exp != 0]
    assert result.threshold == pytest.approx(_kth_largest(nonzero, result.k), rel=0.05)


def test_topk_and_hard(samples):
    values = samples["gpd"][:100_000]
    result = estimate_threshold(values, 0.01, "topk")
    assert result.selected == result.k == 1000
    assert result.threshold == _kth_largest(values, 1000)
    assert int(_chosen(result, values).sum()) == 1000
    hard = estimate_threshold(values, 0.01, "hard", threshold=0.02)
    assert hard.selected == int((values.abs() >= 0.02).sum())
    assert hard.quality == hard.selected / 1000


def test_dgc(samples):
    values = samples["gpd"]
    results = [
        estimate_threshold(values, r, "dgc", generator=torch.Generator().manual_seed(3))
        for r in (0.01, 0.001)
    ]
    for result in results:
        assert 0.8 <= result.quality <= 1.3
        assert result.selected == int(_chosen(result, values).sum())
    again = estimate_threshold(values, 0.01, "dgc", generator=torch.Generator().manual_seed(3))
    assert again == results[0]


def test_dgc_counts_the_non_zeros_only_when_its_candidates_do_not_show_k():
    """Enough candidates above a positive threshold are k non-zero values: no pass to
    count them (a row long enough to be scanned in place, as a replay's are: one count
    and one compaction at the sampled threshold). Fewer (or a zero threshold) still
    count, and fail as a check up front."""
    rng = np.random.default_rng(4)
    values = torch.from_numpy(rng.laplace(size=COMPILED_MIN_NUMEL).astype(np.float32))
    shared = RowPasses(values)
    first = estimate_threshold(
        values, 0.001, "dgc", generator=torch.Generator().manual_seed(1), shared=shared
    )
    assert 0.8 <= first.quality <= 1.3 and shared.scans == 2
    mostly_zero = torch.zeros(COMPILED_MIN_NUMEL)
    mostly_zero[:150] = torch.arange(1.0, 151.0)  # k = 4194
    shared = RowPasses(mostly_zero)
    with pytest.raises(UsageError, match="150 non-zero"):
        generator = torch.Generator().manual_seed(1)
        estimate_threshold(mostly_zero, 0.001, "dgc", generator=generator, shared=shared)
    assert shared.scans == 2  # a count at the threshold, then the non-zeros


def _dgc_reference(values: torch.Tensor, k: int, seed: int) -> tuple[float, int]:
    """DGC as its paper states it, on the whole row: the smallest of the top
    ceil(size * k / d) of a 1% sample (at least 2d/k); the candidates |x| >= t; exact
    top-k of them when over 1.3k, done when at least 0.8k, else t * 0.8."""
    a = values.reshape(-1).abs()
    d = a.numel()
    size = min(d, max(math.ceil(0.01 * d), math.ceil(2.0 * d / k)))
    index = torch.randint(d, (size,), generator=torch.Generator().manual_seed(seed))
    t = float(torch.topk(a[index], max(1, math.ceil(size * k / d))).values.min())
    while True:
        candidates = a[a >= t]
        if candidates.numel() > 1.3 * k:
            return float(torch.topk(candidates, k).values.min()), k
        if candidates.numel() >= 0.8 * k:
            return t, candidates.numel()
        t *= 0.8


@pytest.mark.parametrize("shared", ["passes", "histogram", None])
def test_dgc_equals_the_plain_algorithm(samples, shared):
    """Through the row's passes or its histogram (which answer the count above the
    sampled threshold and the k-th largest instead of handing over the candidates)."""
    from gradstat.stats.histogram import RowHistogram

    values = samples["gpd"]
    tied = torch.ones(100_000)
    tied[:50] = 2.0  # the sample's threshold selects over 1.3k: the exact top-k follows
    for row, ratio in ((values, 0.01), (values, 0.001), (tied, 0.001)):
        kinds = {"passes": RowPasses(row), "histogram": RowHistogram(row), None: None}
        result = estimate_threshold(
            row, ratio, "dgc", generator=torch.Generator().manual_seed(5), shared=kinds[shared]
        )
        expected = _dgc_reference(row, k_for(ratio, row.numel()), 5)
        assert (result.threshold, result.selected) == expected


def test_dgc_falls_back_to_exact_topk_on_candidates():
    # A sample that hits many ties at the threshold selects > 1.3k: exact top-k follows.
    values = torch.ones(100_000)
    values[:50] = 2.0
    result = estimate_threshold(values, 0.001, "dgc", generator=torch.Generator().manual_seed(0))
    assert result.selected == result.k == 100


def test_gaussiank_on_normal_data(samples):
    values = samples["normal"]
    for ratio in (0.01, 0.001):
        result = estimate_threshold(values, ratio, "gaussiank")
        assert result.quality == pytest.approx(1.0, abs=0.08)
        assert result.threshold == pytest.approx(0.01 * stats.norm.isf(ratio / 2), rel=0.02)


def test_gaussiank_adjusts_on_heavy_tails(samples):
    result = estimate_threshold(samples["gpd"], 0.001, "gaussiank")
    # heavy tails: the normal threshold selects far too many, x1.5 steps bring it down
    assert result.selected < 4 * result.k


def test_redsync_lands_between_k_and_2k(samples):
    for ratio in (0.01, 0.001):
        result = estimate_threshold(samples["gpd"], ratio, "redsync")
        assert result.k < result.selected < 2 * result.k
        assert result.selected == int((samples["gpd"].abs() > result.threshold).sum())


def test_mask_matches_selected(samples):
    values = samples["gamma"][:200_000]
    for estimator in ESTIMATORS:
        result = estimate_threshold(values, 0.01, estimator, threshold=0.05)
        assert int(_chosen(result, values).sum()) == result.selected, estimator


def test_bad_input():
    values = torch.randn(1000)
    with pytest.raises(UsageError, match="unknown estimator"):
        estimate_threshold(values, 0.01, "nope")
    for ratio in (0.0, 1.0, -0.1, 1.5):
        with pytest.raises(UsageError, match="outside"):
            estimate_threshold(values, ratio, "topk")
    with pytest.raises(UsageError, match="stages"):
        estimate_threshold(values, 0.01, "sidco-exp", stages=0)
    with pytest.raises(UsageError, match="hard threshold"):
        estimate_threshold(values, 0.01, "hard")
    sparse = torch.zeros(1000)
    sparse[:5] = 1.0
    for estimator in ("topk", "sidco-gpd", "dgc", "gaussiank", "redsync"):
        with pytest.raises(UsageError, match="non-zero"):
            estimate_threshold(sparse, 0.1, estimator)
        with pytest.raises(DataError, match="zero"):
            estimate_threshold(torch.zeros(1000), 0.1, estimator)
    with pytest.raises(DataError, match="empty"):
        estimate_threshold(torch.zeros(0), 0.1, "topk")
    bad = torch.randn(1000)
    bad[3] = float("nan")
    with pytest.raises(DataError, match="NaN"):
        estimate_threshold(bad, 0.01, "sidco-exp")


def test_k_for_rounds_and_keeps_at_least_one():
    assert [k_for(r, 1000) for r in (0.5, 0.0105, 0.0104, 1e-7)] == [500, 10, 10, 1]
    assert k_for(0.001, 123_457) == 123


def _drive(adaptive: AdaptiveStages, quality_of: dict[int, float], steps: int = 60) -> list[int]:
    used = []
    for _ in range(steps):
        used.append(adaptive.stages)
        adaptive.update(quality_of[adaptive.stages])
    return used


def test_adaptive_stages_goes_up_on_heavy_tails():
    heavy = {1: 6.0, 2: 2.0, 3: 1.1, 4: 0.9, 5: 0.8, 6: 0.7, 7: 0.6, 8: 0.5}
    assert _drive(AdaptiveStages(initial=1), heavy)[-1] == 3


def test_adaptive_stages_goes_down_when_more_stages_undershoot():
    q = {1: 3.0, 2: 1.0, 3: 0.5, 4: 0.3, 5: 0.2, 6: 0.1, 7: 0.1, 8: 0.1}
    used = _drive(AdaptiveStages(initial=5), q)
    assert used[-1] == 2
    assert used[:6] == [5] * 5 + [6]  # first tried upwards, then searched the other way


def test_adaptive_stages_settles_on_the_best_when_none_is_in_band():
    q = {1: 3.0, 2: 1.5, 3: 0.6, 4: 0.3, 5: 0.2, 6: 0.1, 7: 0.1, 8: 0.1}
    assert _drive(AdaptiveStages(initial=1), q)[-1] == 2


def test_adaptive_stages_with_the_estimator(samples):
    adaptive = AdaptiveStages(initial=1, window=2)
    values = samples["gpd"][:500_000]
    for _ in range(12):
        result = estimate_threshold(values, 0.001, "sidco-exp", stages=adaptive.stages)
        adaptive.update(result.quality)
    assert adaptive.stages > 1
    final = estimate_threshold(values, 0.001, "sidco-exp", stages=adaptive.stages)
    assert 0.8 <= final.quality <= 1.25


@pytest.mark.parametrize("n", [0, 1, 7, 1 << 18, (1 << 18) + 1, 3 * (1 << 18) + 5])
def test_compress_equals_boolean_indexing(n):
    """The chunked compress keeps exactly x[keep], in order, across chunk boundaries
    (chunks of 2^18), also with nothing or everything kept."""
    x = torch.from_numpy(np.random.default_rng(n).standard_normal(n).astype(np.float32))
    for keep in (x > 0.3, torch.zeros(n, dtype=torch.bool), torch.ones(n, dtype=torch.bool)):
        assert torch.equal(compress(x, keep), x[keep])


def test_compiled_row_sums_equal_float64_sums():
    """A long CPU row's sums come from the compiled loops (``row_sums``): float64 sums of
    the same values (torch's float32 chunk sums would miss 1e-12), the exact maximum
    and counts; NaN or Inf is the same error as elsewhere."""
    rng = np.random.default_rng(8)
    values = torch.from_numpy(rng.standard_t(3, COMPILED_MIN_NUMEL + 1).astype(np.float32))
    values[::9] = 0.0
    values[123] = -400.0  # the largest magnitude, negative
    sums = RowPasses(values).sums()
    x = values.numpy().astype(np.float64)
    assert (sums.numel, sums.nonzeros) == (x.size, np.count_nonzero(x))
    assert sums.signed_total == pytest.approx(x.sum(), rel=1e-12)
    assert sums.total == pytest.approx(np.abs(x).sum(), rel=1e-12)
    assert sums.squares == pytest.approx((x * x).sum(), rel=1e-12)
    assert sums.maximum == 400.0
    for bad in (np.nan, np.inf, -np.inf):
        broken = values.clone()
        broken[5] = bad
        with pytest.raises(DataError, match="NaN or Inf"):
            RowPasses(broken).sums()
