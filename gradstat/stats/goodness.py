"""Goodness of fit without p-values (docs/methods.md 1).

With millions of gradient values every p-value is ~0, so gradstat reports statistics:
Kolmogorov-Smirnov D, Anderson-Darling A^2, the relative error of the fitted upper
quantile against the empirical one at each target density, and AIC/BIC. KS and AD need
sorted data; :func:`subsample` draws a uniform subset without replacement when asked.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from gradstat.stats.distributions import Distribution


def subsample(x: torch.Tensor, size: int | None, seed: int = 0) -> torch.Tensor:
    """Up to ``size`` elements of ``x`` drawn uniformly without replacement (all if None)."""
    if size is None or x.numel() <= size:
        return x
    index = np.random.default_rng(seed).choice(x.numel(), size=size, replace=False)
    return x[torch.from_numpy(np.sort(index))]


def _sorted(x: torch.Tensor, presorted: bool) -> torch.Tensor:
    x = x.reshape(-1).double()
    return x if presorted else torch.sort(x).values


def ks_from_cdf(cdf: torch.Tensor) -> float:
    """Kolmogorov-Smirnov D = sup |F_n - F| from F at the ascending sample (as
    scipy.stats.kstest computes it)."""
    n = cdf.numel()
    above = torch.arange(1, n + 1, dtype=torch.float64).div_(n).sub_(cdf)  # i/n - F
    below = 1.0 / n - float(above.amin())  # max F - (i-1)/n
    return max(float(above.amax()), below)


def ad_from_logs(logcdf: torch.Tensor, logsf: torch.Tensor) -> float:
    """Anderson-Darling A^2 = -n - (1/n) sum (2i - 1)[ln F(x_(i)) + ln S(x_(n+1-i))]
    (Anderson & Darling 1954) from log F and log S at the ascending sample, with logs
    for accuracy in the tails; +inf when a value lies outside the fitted support."""
    n = logcdf.numel()
    weights = torch.arange(1, 2 * n, 2, dtype=torch.float64)
    value = -n - float((weights * (logcdf + logsf.flip(0))).sum()) / n
    return value if not math.isnan(value) else math.inf


def ks_ad(x: torch.Tensor, dist: Distribution, presorted: bool = False) -> tuple[float, float]:
    """(KS D, AD A^2) from one evaluation of the fitted tails
    (:meth:`~gradstat.stats.distributions.Distribution.sorted_tails`)."""
    tails = dist.sorted_tails(_sorted(x, presorted))
    return ks_from_cdf(tails.cdf), ad_from_logs(tails.logcdf, tails.logsf)


def ks_statistic(x: torch.Tensor, dist: Distribution, presorted: bool = False) -> float:
    """Kolmogorov-Smirnov D alone (:func:`ks_ad`). ``presorted``: ``x`` is already in
    ascending order (sort once, score many fits)."""
    return ks_from_cdf(dist.cdf(_sorted(x, presorted)))


def ad_statistic(x: torch.Tensor, dist: Distribution, presorted: bool = False) -> float:
    """Anderson-Darling A^2 alone (:func:`ks_ad`)."""
    return ks_ad(x, dist, presorted)[1]


def quantile_error(fitted: float, empirical: float) -> float:
    """Relative error of a fitted upper quantile: (fitted - empirical) / empirical."""
    return (fitted - empirical) / empirical


def information_criteria(loglik: float, n_params: int, n: int) -> tuple[float, float]:
    """(AIC, BIC) = (2p - 2 ln L, p ln n - 2 ln L)."""
    return 2.0 * n_params - 2.0 * loglik, n_params * math.log(n) - 2.0 * loglik
