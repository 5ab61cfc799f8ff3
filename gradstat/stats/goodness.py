"""Goodness of fit without p-values (docs/methods.md 1).

With millions of gradient values every p-value is ~0, so gradstat reports statistics:
Kolmogorov-Smirnov D, Anderson-Darling A^2, the relative error of the fitted upper
quantile against the empirical one at each target density, and AIC/BIC. KS and AD need
sorted data; :func:`subsample` draws a uniform subset without replacement when asked.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from gradstat.stats.distributions import Distribution


def subsample(x: torch.Tensor, size: int | None, seed: int = 0) -> torch.Tensor:
    """Up to ``size`` elements of ``x`` (all if None), drawn uniformly without
    replacement (every ``size``-subset equally likely), in their original order."""
    n = x.numel()
    if size is None or n <= size:
        return x
    index = _positions(n, size, seed)
    flat = x.reshape(-1)
    if flat.device.type == "cpu":  # numpy's gather: 1M of 32M values in 4 ms, torch's 9 ms
        return torch.from_numpy(flat.numpy()[index])
    return flat[torch.from_numpy(index.astype(np.int64)).to(flat.device)]


@functools.lru_cache(maxsize=1)
def _positions(n: int, size: int, seed: int) -> np.ndarray:
    """The ``size`` positions of ``n`` that :func:`subsample` keeps, ascending, read-only:
    they depend on the count and the seed alone, so ``fit``'s rows of one length share
    one draw (1M of 32M: 16 ms a row)."""
    rng = np.random.default_rng(seed)
    if n <= 4 * size:  # numpy's exact draw; the n-element index it builds is small here
        index = np.sort(rng.choice(n, size=size, replace=False))
    else:
        index = _bernoulli_draw(rng, n, size)
    index.flags.writeable = False
    return index


def _bernoulli_draw(rng: np.random.Generator, n: int, size: int) -> np.ndarray:
    """``size`` distinct positions of ``n``, uniformly, ascending, in O(size) time and
    memory, no sort: every position is kept with probability p = size / n (the gaps
    between kept positions are geometric, so the running sums of geometric draws are that
    Bernoulli sample), then a uniform subset of the surplus is dropped, or a uniform subset
    of the positions left out is added to make up the shortfall. Given its count a
    Bernoulli sample is a uniform subset of that count, so each step keeps every
    ``size``-subset equally likely. (numpy's ``choice(n, size, replace=False)`` builds an
    n-element index when size > n/50: 256 MB for a 1M sample of 32M values; drawing with
    replacement and sorting out repeats took 4x as long.)"""
    p = size / n
    kept = np.cumsum(rng.geometric(p, size=size + 4 * math.isqrt(size) + 16)) - 1
    while kept[-1] < n - 1:  # the draws did not reach the end: continue past the last
        more = np.cumsum(rng.geometric(p, size=4 * math.isqrt(size) + 16)) + kept[-1]
        kept = np.concatenate([kept, more])
    kept = kept[kept < n]
    if kept.size > size:
        drop = rng.choice(kept.size, size=kept.size - size, replace=False)
        return np.delete(kept, drop)
    missing = np.empty(0, dtype=kept.dtype)
    while kept.size + missing.size < size:  # uniform among the positions not yet in
        draw = rng.integers(0, n, size=size - kept.size - missing.size)
        fresh = draw[~np.isin(draw, kept) & ~np.isin(draw, missing)]
        _, first = np.unique(fresh, return_index=True)  # repeats out, in the drawn order
        fresh = fresh[np.sort(first)][: size - kept.size - missing.size]
        missing = np.concatenate([missing, fresh])
    return np.union1d(kept, missing)


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


def quantile_error(fitted: float, empirical: float) -> float:
    """Relative error of a fitted upper quantile: (fitted - empirical) / empirical."""
    return (fitted - empirical) / empirical


def information_criteria(loglik: float, n_params: int, n: int) -> tuple[float, float]:
    """(AIC, BIC) = (2p - 2 ln L, p ln n - 2 ln L)."""
    return 2.0 * n_params - 2.0 * loglik, n_params * math.log(n) - 2.0 * loglik
