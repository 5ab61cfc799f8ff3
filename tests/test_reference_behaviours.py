"""The SIDCo reference's behaviours on request (sands-lab/SIDCo, compression.py), each
against an independent numpy re-implementation of the reference's rule or a fixed vector
worked by hand, and SIDCo's stages fitted by maximum likelihood."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch
from scipy import special, stats

from gradstat.errors import UsageError
from gradstat.stats.sidco import MLE_SAMPLE
from gradstat.stats.thresholds import estimate_threshold

N = 1_000_000


@pytest.fixture(scope="module")
def with_zeros() -> torch.Tensor:
    """Heavy-tailed signed values with 8% exact zeros (dead units)."""
    rng = np.random.default_rng(11)
    x = stats.genpareto(c=0.2, scale=0.01).rvs(N, random_state=rng)
    x *= rng.choice([-1.0, 1.0], size=N)
    x[rng.random(N) < 0.08] = 0.0
    return torch.from_numpy(x.astype(np.float32))


def _reference_sidco(x: np.ndarray, ratio: float, stages: int, first: str) -> list[float]:
    """The reference's multi-stage rule on every element (zeros included), in float64:
    magnitudes normalised by ||x||_2, torch.var's ddof 1, log(a + eps) for the gamma.
    Its gamma quantile is replaced by the exact one (gradstat's documented deviation)."""
    norm = np.linalg.norm(x)
    a = np.abs(x) / norm
    per = (ratio / 0.25) ** (1.0 / (stages - 1))

    def gpd(v: np.ndarray, density: float) -> float:
        mean, var = v.mean(), v.var(ddof=1)
        alpha = 0.5 * mean * (mean**2 / var + 1.0)
        k = 0.5 * (mean**2 / var - 1.0)
        return alpha * (1.0 - math.exp(k * math.log(density))) / k

    if first == "exp":
        eta = -a.mean() * math.log(0.25)
    elif first == "gpd":
        eta = gpd(a, 0.25)
    else:
        mean = a.mean()
        s = math.log(mean) - np.log(a + sys.float_info.epsilon).mean()
        shape = (3 - s + math.sqrt((s - 3) ** 2 + 24 * s)) / (12 * s)
        eta = mean / shape * special.gammainccinv(shape, 0.25)
    etas = [eta]
    for _ in range(stages - 1):
        a = a[a > eta]
        low = a.min()
        eta = low + (-(a.mean() - low) * math.log(per) if first == "exp" else gpd(a - low, per))
        etas.append(eta)
    return [e * norm for e in etas]


@pytest.mark.parametrize("estimator", ["sidco-exp", "sidco-gpd", "sidco-gamma-gpd"])
def test_zeros_include_follows_the_reference_rule(with_zeros, estimator):
    first = estimator.split("-")[1]
    expected = _reference_sidco(with_zeros.double().numpy(), 0.001, 3, first)
    got = estimate_threshold(with_zeros, 0.001, estimator, stages=3, zeros="include")
    np.testing.assert_allclose(got.stage_thresholds, expected, rtol=2e-4)
    excluded = estimate_threshold(with_zeros, 0.001, estimator, stages=3)
    # the rule matters: 8% zeros move the first stage (and so every later one)
    assert abs(excluded.stage_thresholds[0] / got.stage_thresholds[0] - 1) > 0.02


def _gaussiank(x: np.ndarray, k: int) -> tuple[float, int]:
    """Gaussian-k as the reference loops: mean/std of x at density k / x.size, at most
    2 adjustments applied (the loop's third is computed and discarded)."""
    threshold = x.mean() + stats.norm.isf(k / x.size / 2) * x.std()
    for loop in range(3):
        selected = int((np.abs(x) > threshold).sum())
        if 2 * k / 3 <= selected <= 4 * k / 3 or loop == 2:
            break
        threshold *= 0.5 if selected < 2 * k / 3 else 1.5
    return threshold, selected


@pytest.mark.parametrize("zeros", ["include", "exclude"])
def test_gaussiank_zeros_rule(with_zeros, zeros):
    x = with_zeros.double().numpy()
    threshold, selected = _gaussiank(x if zeros == "include" else x[x != 0], 1000)
    got = estimate_threshold(with_zeros, 0.001, "gaussiank", zeros=zeros)
    assert got.threshold == pytest.approx(threshold, rel=1e-5)
    assert got.selected == selected


def test_unknown_choices_are_usage_errors(with_zeros):
    with pytest.raises(UsageError, match="--zeros"):
        estimate_threshold(with_zeros, 0.01, "sidco-exp", zeros="some")
    with pytest.raises(UsageError, match="--stage-fit"):
        estimate_threshold(with_zeros, 0.01, "sidco-gpd", stage_fit="lsq")


# --- RedSync: the paper's search and the reference's ----------------------------------
@pytest.fixture(scope="module")
def ramp() -> torch.Tensor:
    """|x| = 1, 2, ..., 1000 with alternating signs: mean 500.5, max 1000, so a probe
    t selects the 1000 - floor(500.5 + 499.5 t) values above it."""
    x = np.arange(1, 1001, dtype=np.float32)
    x[::2] *= -1
    return torch.from_numpy(x)


def test_redsync_as_the_paper_states_it(ramp):
    # k = 10: t = 1/2 (250), 3/4 (125), 7/8 (63), 15/16 (32) all >= 2k, raise; 31/32: 16
    result = estimate_threshold(ramp, 0.01, "redsync")
    assert (result.threshold, result.selected) == (500.5 + 31 / 32 * 499.5, 16)
    # k = 300: t = 1/2 selects 250 <= k, lower; t = 1/4 selects 375 in (k, 2k): stop
    result = estimate_threshold(ramp, 0.3, "redsync")
    assert (result.threshold, result.selected) == (500.5 + 0.25 * 499.5, 375)


def test_redsync_as_the_sidco_reference_runs_it(ramp):
    # at most 3 probes (stop once r - l <= 0.2): t = 1/2, 3/4, 7/8 all raise; q = 6.3
    result = estimate_threshold(ramp, 0.01, "redsync-sidco")
    assert (result.threshold, result.selected) == (500.5 + 7 / 8 * 499.5, 63)
    # k = 300: 250 is in [k/2, k], and the reference raises the threshold there (l = 1/2);
    # 3/4 selects 125 < k/2, lower; 5/8 selects 188, raise; the interval is now 1/8
    result = estimate_threshold(ramp, 0.3, "redsync-sidco")
    assert (result.threshold, result.selected) == (500.5 + 5 / 8 * 499.5, 188)


# --- Gaussian-k: at most 2 adjustments, as the reference applies them -----------------
def test_gaussiank_applies_at_most_two_adjustments():
    # Cauchy-like tails: the normal quantile selects far too many; every count is above
    # 4k/3, so the reference raises x1.5 twice and discards its third adjustment.
    rng = np.random.default_rng(6)
    x = rng.standard_t(1.0, size=20_000).astype(np.float32)
    values = torch.from_numpy(x)
    k = 20
    x64 = x.astype(np.float64)
    first = x64.mean() + stats.norm.isf(k / x.size / 2) * x64.std()
    counts = [int((np.abs(x) > first * 1.5**j).sum()) for j in range(4)]
    assert all(c > 4 * k / 3 for c in counts[:3])  # the vector needs more than 2
    result = estimate_threshold(values, 0.001, "gaussiank")
    assert result.threshold == pytest.approx(first * 2.25, rel=1e-6)
    assert result.selected == counts[2]
    assert (result.threshold, result.selected) == pytest.approx(_gaussiank(x64, k), rel=1e-6)
    assert counts[3] <= 4 * k / 3  # a third adjustment would have landed in the band


def test_gaussiank_halves_at_most_twice():
    # One outlier inflates sigma: the normal threshold (~23) selects only the outlier;
    # halving twice (~5.8) still does; a third halving (~2.9) would select ~75.
    x = np.random.default_rng(0).normal(size=20_000)
    x[0] = 1000.0
    first = x.mean() + stats.norm.isf(20 / x.size / 2) * x.std()
    result = estimate_threshold(torch.from_numpy(x.astype(np.float32)), 0.001, "gaussiank")
    assert result.threshold == pytest.approx(first / 4, rel=1e-6)
    assert result.selected == 1 == int((np.abs(x) > first / 4).sum())
    assert int((np.abs(x) > first / 8).sum()) > 20


# --- SIDCo stages fitted by maximum likelihood ----------------------------------------
def test_mle_stage_is_the_gpd_mle_of_the_excesses():
    # 120K values, 2 stages at 0.01: stage 2 fits 30K excesses (under MLE_SAMPLE: all)
    rng = np.random.default_rng(2)
    x = stats.genpareto(c=0.4, scale=1.0).rvs(120_000, random_state=rng)
    values = torch.from_numpy(x.astype(np.float32))
    result = estimate_threshold(values, 0.01, "sidco-gpd", stages=2, stage_fit="mle")
    a = np.abs(values.numpy()).astype(np.float64)
    above = a[a > result.stage_thresholds[0]]
    assert above.size <= MLE_SAMPLE
    c, _, scale = stats.genpareto.fit(above - above.min(), floc=0)
    per = result.densities[1]
    expected = above.min() + stats.genpareto(c, scale=scale).isf(per)
    assert result.stage_thresholds[1] == pytest.approx(expected, rel=1e-3)


def test_mle_stages_keep_q_near_one_where_moments_fail():
    # c = 0.6: the variance does not exist, moment fits of later stages are biased
    rng = np.random.default_rng(4)
    x = stats.genpareto(c=0.6, scale=1.0).rvs(2_000_000, random_state=rng)
    x *= rng.choice([-1.0, 1.0], size=x.size)
    values = torch.from_numpy(x.astype(np.float32))
    moments = estimate_threshold(values, 0.001, "sidco-gpd", stages=3)
    mle = estimate_threshold(values, 0.001, "sidco-gpd", stages=3, stage_fit="mle")
    assert abs(math.log(mle.quality)) < 0.1
    assert abs(math.log(moments.quality)) > 2 * abs(math.log(mle.quality))
    exp = estimate_threshold(values, 0.001, "sidco-exp", stages=3)
    assert estimate_threshold(values, 0.001, "sidco-exp", stages=3, stage_fit="mle") == exp


def test_mle_first_stage_on_a_vector_too_sparse_to_subsample():
    # 10 non-zeros off the subsample's stride (7): stage 1 falls back to its moments fit
    values = torch.zeros(1_000_000)
    values[7 * np.arange(1, 11) * 1000 + 1] = torch.arange(1.0, 11.0)
    result = estimate_threshold(values, 5e-6, "sidco-gpd", stages=2, stage_fit="mle")
    moments = estimate_threshold(values, 5e-6, "sidco-gpd", stages=2)
    assert math.isfinite(result.threshold)
    assert result.stage_thresholds[0] == moments.stage_thresholds[0]
    assert result.selected == int((values.abs() > result.threshold).sum())
