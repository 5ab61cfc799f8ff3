"""Distributions and their fits against scipy.stats."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from gradstat.errors import DataError, UsageError
from gradstat.stats import mle
from gradstat.stats.distribution_base import mean_var
from gradstat.stats.distributions import (
    DISTRIBUTIONS,
    Exponential,
    Folded,
    Gamma,
    GenPareto,
    Normal,
    get_distribution,
)
from gradstat.stats.goodness import subsample

# (name, scipy distribution with known parameters, the parameters as gradstat names them)
CASES = [
    ("exp", stats.expon(scale=0.02), {"loc": 0.0, "scale": 0.02}),
    ("gamma", stats.gamma(a=0.7, scale=0.03), {"a": 0.7, "loc": 0.0, "scale": 0.03}),
    ("gpd", stats.genpareto(c=0.25, scale=0.01), {"c": 0.25, "loc": 0.0, "scale": 0.01}),
    ("normal", stats.norm(loc=0.001, scale=0.02), {"loc": 0.001, "scale": 0.02}),
    ("laplace", stats.laplace(loc=-0.002, scale=0.01), {"loc": -0.002, "scale": 0.01}),
    ("lognormal", stats.lognorm(s=1.2, scale=0.005), {"s": 1.2, "loc": 0.0, "scale": 0.005}),
    ("weibull", stats.weibull_min(c=0.8, scale=0.01), {"c": 0.8, "loc": 0.0, "scale": 0.01}),
]
IDS = [case[0] for case in CASES]


def _draw(frozen, n: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(frozen.rvs(n, random_state=np.random.default_rng(seed)))


def _ordered(fitted) -> list[float]:
    """Parameters in scipy's positional order: shapes, loc, scale."""
    shapes = fitted.to_scipy().dist.shapes
    keys = [*(shapes.split(", ") if shapes else []), "loc", "scale"]
    return [fitted.params[key] for key in keys]


@pytest.mark.parametrize(("name", "frozen", "true"), CASES, ids=IDS)
def test_functions_agree_with_scipy(name, frozen, true):
    dist = get_distribution(name)(**true)
    ref = dist.to_scipy()
    assert ref.dist.name == dist.scipy_name
    lo, hi = frozen.ppf(1e-9), frozen.isf(1e-9)
    x = np.concatenate([np.linspace(lo, hi, 401), frozen.ppf([0.01, 0.5, 0.99])])
    np.testing.assert_allclose(dist.logpdf(x).numpy(), ref.logpdf(x), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dist.pdf(x).numpy(), ref.pdf(x), rtol=1e-10)
    np.testing.assert_allclose(dist.cdf(x).numpy(), ref.cdf(x), rtol=1e-9, atol=1e-300)
    np.testing.assert_allclose(dist.sf(x).numpy(), ref.sf(x), rtol=1e-9, atol=1e-300)
    np.testing.assert_allclose(dist.logcdf(x[1:]).numpy(), ref.logcdf(x[1:]), rtol=1e-9)
    np.testing.assert_allclose(dist.logsf(x[:-5]).numpy(), ref.logsf(x[:-5]), rtol=1e-9)
    q = np.array([1e-8, 1e-4, 0.001, 0.01, 0.25, 0.5, 0.9, 0.999])
    np.testing.assert_allclose(dist.ppf(q).numpy(), ref.ppf(q), rtol=1e-9)
    np.testing.assert_allclose(dist.isf(q).numpy(), ref.isf(q), rtol=1e-9)


@pytest.mark.parametrize(("name", "frozen", "true"), CASES, ids=IDS)
def test_sorted_tails_agree_with_scipy_in_both_tails(name, frozen, true):
    # KS and AD take the CDF, log-CDF and log-SF from one evaluation per element
    # (the CDF below the median, the SF above): both far tails keep full precision.
    dist = get_distribution(name)(**true).magnitudes()
    mags = np.sort(np.abs(frozen.rvs(2000, random_state=np.random.default_rng(3))))
    x = np.unique(
        np.concatenate([mags, np.abs(frozen.ppf([1e-12, 0.5])), np.abs(frozen.isf([1e-12]))])
    )
    x = x[x > 0]
    tails = dist.sorted_tails(torch.from_numpy(x))
    np.testing.assert_allclose(tails.cdf.numpy(), dist.cdf(x).numpy(), rtol=1e-12, atol=1e-300)
    np.testing.assert_allclose(tails.logcdf.numpy(), dist.logcdf(x).numpy(), rtol=1e-10)
    np.testing.assert_allclose(tails.logsf.numpy(), dist.logsf(x).numpy(), rtol=1e-10)
    if not isinstance(dist, Folded):  # the folded normal: test_folded_normal_is_scipys_foldnorm
        scipy_dist = dist.to_scipy()
        np.testing.assert_allclose(tails.logcdf.numpy(), scipy_dist.logcdf(x), rtol=1e-9)
        np.testing.assert_allclose(tails.logsf.numpy(), scipy_dist.logsf(x), rtol=1e-9)


@pytest.mark.parametrize(("name", "frozen", "true"), CASES, ids=IDS)
def test_moments_fit_matches_the_sample_moments_exactly(name, frozen, true):
    x = _draw(frozen, 50_000)
    cls = get_distribution(name)
    data = x if cls.signed else x.abs()
    fitted = cls.fit(data, method="moments")
    values = data.numpy()
    ref_dist = fitted.to_scipy().dist
    moments = 1 if name == "exp" else 2  # the exponential has one parameter: the mean

    def mismatch(params) -> float:
        mean, var = ref_dist.stats(*params, moments="mv")
        return abs(mean / values.mean() - 1) + (moments - 1) * abs(var / values.var() - 1)

    assert mismatch(_ordered(fitted)) < 1e-9
    if name != "gpd":  # scipy's numerical MM fit fails on the GPD (moments of c >= 1/2)
        # scipy solves the same equations with an optimiser: ours are at least as exact
        scipy_mm = ref_dist.fit(values, method="MM", **({} if cls.signed else {"floc": 0}))
        np.testing.assert_allclose(_ordered(fitted), scipy_mm, rtol=0.03, atol=1e-9)
        assert mismatch(_ordered(fitted)) <= mismatch(scipy_mm) + 1e-12
    for key, value in true.items():
        assert fitted.params[key] == pytest.approx(value, rel=0.1, abs=1e-3 * true["scale"])


@pytest.mark.parametrize(("name", "frozen", "true"), CASES, ids=IDS)
def test_mle_agrees_with_truth_and_scipy(name, frozen, true):
    x = _draw(frozen, 20_000, seed=1)
    cls = get_distribution(name)
    data = x if cls.signed else x.abs()
    values = data.numpy()
    fitted = cls.fit(data, method="mle")
    ref_dist = fitted.to_scipy().dist
    ref_params = ref_dist.fit(values) if cls.signed else ref_dist.fit(values, floc=0)
    ours = _ordered(fitted)
    np.testing.assert_allclose(ours, ref_params, rtol=2e-3, atol=1e-6 * true["scale"])
    for key, value in true.items():
        assert fitted.params[key] == pytest.approx(value, rel=0.05, abs=0.05 * true["scale"])
    ll_scipy = ref_dist.logpdf(values, *ref_params).sum()
    ll_ours = fitted.loglik(data)
    assert ll_ours == pytest.approx(ref_dist(*ours).logpdf(values).sum(), rel=1e-10)
    assert ll_ours >= ll_scipy - 1e-7 * abs(ll_scipy)


def test_gpd_mle_on_light_and_heavy_tails():
    for c in (-0.3, 0.0, 0.6):
        values = stats.genpareto(c=c, scale=1.0).rvs(50_000, random_state=2)
        fitted = GenPareto.fit(torch.from_numpy(values), method="mle")
        ref = stats.genpareto.fit(values, floc=0)
        assert fitted.params["c"] == pytest.approx(c, abs=0.03)
        ll_ref = stats.genpareto.logpdf(values, *ref).sum()
        assert fitted.loglik(torch.from_numpy(values)) >= ll_ref - 1e-7 * abs(ll_ref)


def test_gamma_closed_form_is_close_to_the_mle():
    values = _draw(stats.gamma(a=0.5, scale=1.0), 100_000)
    closed = Gamma.from_log_moments(float(values.mean()), float(values.log().mean()))
    mle = Gamma.fit(values, method="mle")
    assert closed.params["a"] == pytest.approx(mle.params["a"], rel=0.02)


@pytest.mark.parametrize("name", ["normal", "laplace"])
def test_magnitude_quantile_of_signed_distributions(name):
    cls = get_distribution(name)
    dist = cls(loc=0.003, scale=0.01)
    ref = dist.to_scipy()
    for density in (0.1, 0.01, 0.001):
        t = dist.magnitude_isf(density)
        assert ref.sf(t) + ref.cdf(-t) == pytest.approx(density, rel=1e-9)


def test_magnitude_quantile_of_magnitude_distributions():
    dist = Exponential(loc=0.0, scale=2.0)
    assert dist.magnitude_isf(0.01) == pytest.approx(stats.expon(scale=2.0).isf(0.01))
    assert float(dist.magnitudes().sf(3.0)) == pytest.approx(stats.expon(scale=2.0).sf(3.0))


def test_folded_normal_is_scipys_foldnorm():
    dist = Normal(loc=0.004, scale=0.01).magnitudes()
    assert isinstance(dist, Folded) and dist.n_params == 2
    ref = stats.foldnorm(c=0.4, scale=0.01)
    t = np.concatenate([np.linspace(0.0, ref.isf(1e-12), 301), [-0.01]])
    np.testing.assert_allclose(dist.logpdf(t).numpy(), ref.logpdf(t), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dist.cdf(t).numpy(), ref.cdf(t), rtol=1e-9, atol=1e-300)
    np.testing.assert_allclose(dist.sf(t).numpy(), ref.sf(t), rtol=1e-9, atol=1e-300)
    np.testing.assert_allclose(dist.logsf(t[:-1]).numpy(), ref.logsf(t[:-1]), rtol=1e-9)
    tails = dist.sorted_tails(torch.from_numpy(t[1:-1]))
    np.testing.assert_allclose(tails.logcdf.numpy(), ref.logcdf(t[1:-1]), rtol=1e-9)
    np.testing.assert_allclose(tails.logsf.numpy(), ref.logsf(t[1:-1]), rtol=1e-9)
    q = np.array([1e-3, 0.25, 0.9])
    np.testing.assert_allclose(dist.isf(q).numpy(), ref.isf(q), rtol=1e-9)
    np.testing.assert_allclose(dist.ppf(q).numpy(), ref.ppf(q), rtol=1e-9)
    # scipy's isf is ppf(1 - q): 1e-9 loses digits there; the exact sf checks ours
    assert ref.sf(float(dist.isf(1e-9))) == pytest.approx(1e-9, rel=1e-9)


def test_gpd_mle_warm_start_finds_the_same_root():
    values = stats.genpareto(c=0.4, scale=2.0).rvs(30_000, random_state=3)
    cold = mle.gpd(values)
    for start in [(0.0, 1.0), (0.9, 0.5), (-0.2, 5.0), cold]:
        assert mle.gpd(values, start) == pytest.approx(cold, rel=1e-8)


def test_a_sample_of_the_magnitudes_is_the_sample_of_the_signed_values():
    """``fit`` fits signed models to a subsample of the signed non-zeros and scores them
    on a subsample of the magnitudes: the same positions (``subsample`` draws them from
    the count and the seed alone), so one is |x| of the other."""
    rng = np.random.default_rng(4)
    signed = torch.from_numpy(rng.standard_normal(50_000).astype(np.float32))
    for size in (1000, 20_000):  # the Bernoulli draw and the exact draw of ``subsample``
        sample = subsample(signed, size, seed=3)
        assert torch.equal(subsample(signed.abs(), size, seed=3), sample.abs())


def test_bad_input():
    with pytest.raises(UsageError, match="unknown distribution"):
        get_distribution("cauchy")
    with pytest.raises(UsageError, match="unknown fit method"):
        Exponential.fit(torch.ones(10), method="bayes")
    with pytest.raises(DataError, match="at least 2"):
        GenPareto.fit(torch.ones(1))
    for name, cls in DISTRIBUTIONS.items():
        for method in ("moments", "mle"):
            if name == "exp":
                continue  # a constant sample has a perfectly good exponential fit
            with pytest.raises(DataError):
                cls.fit(torch.full((100,), 0.5, dtype=torch.float64), method=method)


def test_moments_merged_over_chunks_equal_float64_moments():
    # the moments fits' mean and variance, one pass merging chunks (3 chunks and a
    # tail): numpy's float64 two-pass values, also where the mean is 10^4 standard
    # deviations from zero (E[x^2] - E[x]^2 in float64 would keep ~8 digits)
    rng = np.random.default_rng(8)
    for offset in (0.0, 1e4):
        x = (offset + rng.standard_normal(3 * (1 << 18) + 12_345)).astype(np.float32)
        mean, var = mean_var(torch.from_numpy(x))
        wide = x.astype(np.float64)
        assert mean == pytest.approx(wide.mean(), rel=1e-14)
        assert var == pytest.approx(((wide - wide.mean()) ** 2).mean(), rel=1e-12)
