"""Goodness-of-fit statistics against scipy.stats."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from gradstat.stats.distributions import Exponential, GenPareto, Laplace, Normal
from gradstat.stats.goodness import (
    information_criteria,
    ks_ad,
    quantile_error,
    subsample,
)


def ks_statistic(x: torch.Tensor, dist) -> float:
    return ks_ad(x, dist)[0]


def ad_statistic(x: torch.Tensor, dist) -> float:
    return ks_ad(x, dist)[1]


@pytest.fixture(scope="module")
def heavy() -> torch.Tensor:
    return torch.from_numpy(stats.genpareto(c=0.3, scale=1.0).rvs(5000, random_state=0))


def test_ks_matches_scipy(heavy):
    for dist in (GenPareto(c=0.3, loc=0.0, scale=1.0), Exponential(loc=0.0, scale=1.2)):
        expected = stats.kstest(heavy.numpy(), dist.to_scipy().cdf).statistic
        assert ks_statistic(heavy, dist) == pytest.approx(expected, rel=1e-12)
    # the true distribution fits better than a wrong one
    assert ks_statistic(heavy, GenPareto(c=0.3, loc=0.0, scale=1.0)) < 0.03
    assert ks_statistic(heavy, Exponential(loc=0.0, scale=1.2)) > 0.04


def test_ad_matches_scipy_anderson():
    # scipy.stats.anderson estimates the parameters itself: normal with ddof=1, expon
    # with scale = mean; give our statistic the same distributions.
    x = stats.norm(0.5, 2.0).rvs(3000, random_state=1)
    normal = Normal(loc=x.mean(), scale=x.std(ddof=1))
    assert ad_statistic(torch.from_numpy(x), normal) == pytest.approx(
        stats.anderson(x, "norm", method="interpolate").statistic, rel=1e-9
    )
    y = stats.expon(scale=3.0).rvs(3000, random_state=2)
    assert ad_statistic(torch.from_numpy(y), Exponential(loc=0.0, scale=y.mean())) == (
        pytest.approx(stats.anderson(y, "expon", method="interpolate").statistic, rel=1e-9)
    )


def test_ad_matches_scipy_goodness_of_fit(heavy):
    dist = GenPareto(c=0.25, loc=0.0, scale=1.1)
    result = stats.goodness_of_fit(
        stats.genpareto,
        heavy.numpy(),
        known_params={"c": 0.25, "loc": 0.0, "scale": 1.1},
        statistic="ad",
        n_mc_samples=1,
        rng=0,
    )
    assert ad_statistic(heavy, dist) == pytest.approx(result.statistic, rel=1e-9)


def test_ad_outside_the_support_is_infinite():
    light = GenPareto(c=-0.5, loc=0.0, scale=1.0)  # support [0, 2]
    assert ad_statistic(torch.tensor([0.5, 1.0, 3.0], dtype=torch.float64), light) == math.inf


def test_quantile_error_and_information_criteria(heavy):
    assert quantile_error(1.1, 1.0) == pytest.approx(0.1)
    assert quantile_error(0.5, 1.0) == pytest.approx(-0.5)
    dist = GenPareto(c=0.3, loc=0.0, scale=1.0)
    loglik = float(stats.genpareto(c=0.3, scale=1.0).logpdf(heavy.numpy()).sum())
    aic, bic = information_criteria(dist.loglik(heavy), dist.n_params, heavy.numel())
    assert aic == pytest.approx(4 - 2 * loglik, rel=1e-12)
    assert bic == pytest.approx(2 * math.log(5000) - 2 * loglik, rel=1e-12)


def test_subsample(heavy):
    assert subsample(heavy, None) is heavy
    assert subsample(heavy, 10_000) is heavy
    part = subsample(heavy, 1000, seed=3)
    assert part.numel() == 1000
    assert np.isin(part.numpy(), heavy.numpy()).all()
    assert np.unique(part.numpy()).size == 1000  # without replacement
    assert torch.equal(part, subsample(heavy, 1000, seed=3))
    assert not torch.equal(part, subsample(heavy, 1000, seed=4))


@pytest.mark.parametrize("size", [300, 200])  # numpy's draw (n <= 4 size), distinct draws
def test_subsample_gives_every_element_the_same_chance(size):
    # over many seeds each position is drawn size/n of the time (a binomial spread),
    # every draw without repeats and in the original order
    positions = torch.arange(1000)
    seeds = 2000
    counts = np.zeros(1000)
    for seed in range(seeds):
        drawn = subsample(positions, size, seed=seed).numpy()
        assert drawn.size == size and np.all(np.diff(drawn) > 0)
        counts[drawn] += 1
    assert stats.chisquare(counts).pvalue > 1e-4


def test_folded_normal_and_laplace_on_magnitudes():
    normal = Normal(loc=0.3, scale=1.5)
    folded = normal.magnitudes()
    ref = stats.foldnorm(c=0.3 / 1.5, scale=1.5)
    t = np.linspace(0.0, 8.0, 81)
    np.testing.assert_allclose(folded.cdf(t).numpy(), ref.cdf(t), rtol=1e-9, atol=1e-15)
    np.testing.assert_allclose(folded.sf(t).numpy(), ref.sf(t), rtol=1e-9)
    np.testing.assert_allclose(folded.logpdf(t).numpy(), ref.logpdf(t), rtol=1e-9)
    x = torch.from_numpy(ref.rvs(2000, random_state=5))
    assert ks_statistic(x, folded) == pytest.approx(
        stats.kstest(x.numpy(), ref.cdf).statistic, rel=1e-9
    )
    laplace = Laplace(loc=0.0, scale=2.0)  # folded at 0: the exponential
    expon = stats.expon(scale=2.0)
    np.testing.assert_allclose(laplace.magnitudes().cdf(t).numpy(), expon.cdf(t), rtol=1e-12)
    np.testing.assert_allclose(laplace.magnitudes().logpdf(t).numpy(), expon.logpdf(t))
    assert Exponential(loc=0.0, scale=1.0).magnitudes().params == {"loc": 0.0, "scale": 1.0}


def test_folded_log_survival_in_the_far_tail():
    folded = Normal(loc=0.0, scale=1.0).magnitudes()
    t = np.array([10.0, 30.0, 40.0])
    np.testing.assert_allclose(folded.logsf(t).numpy(), np.log(2) + stats.norm.logsf(t), rtol=1e-9)
