"""Distributions of gradient values and their fits (docs/methods.md section 1).

The sparsity-inducing distributions model magnitudes x = |g| with the location fixed at
0: exponential, gamma and generalized Pareto (GPD), as in SIDCo (Abdelmoniem et al.
2021, arXiv 2101.10761); log-normal and Weibull are there for comparison. Normal and
Laplace model the signed values g; :class:`Folded` turns them into distributions of |g|.
Exact zeros, NaN and Inf are excluded (and counted) before any fit
(:func:`gradstat.analysis.fit.row_records`).

Built as scipy.stats' ``rv_continuous``: the public methods standardise
``z = (x - loc) / scale`` once (``q`` for the quantile functions) and call the
subclass's short standard-form ``_logpdf`` / ``_cdf`` / ``_ppf`` (plus ``_sf``, ``_isf``,
``_logsf`` where precision in the upper tail needs them; the base class falls back to
``1 - cdf``, ``ppf(1 - q)`` and logs that switch sides at 1/2). Parameters are named and
defined as in scipy.stats, so ``dist.to_scipy()`` is the same distribution:

=========  ===============  =====================  ====================================
name       scipy.stats      params                 ``fit(method=...)``
=========  ===============  =====================  ====================================
exp        expon            loc=0, scale           both: scale = mean (MLE = moments)
gamma      gamma            a, loc=0, scale        moments: a = m^2/v; mle: Newton root
                                                   of ln a - digamma(a) = ln m - mean ln x
gpd        genpareto        c, loc=0, scale        moments: docs/methods.md 1; mle:
                                                   profile likelihood (Grimshaw 1993)
normal     norm             loc, scale             both: mean, std (ddof 0)
laplace    laplace          loc, scale             moments: mean, std/sqrt 2; mle: median,
                                                   mean |g - median|
lognormal  lognorm          s, loc=0, scale        moments: s^2 = ln(1 + v/m^2); mle: mean
                                                   and std of ln x
weibull    weibull_min      c, loc=0, scale        moments: root of the CV equation; mle:
                                                   root of the profile score in c
=========  ===============  =====================  ====================================

Every fit needs one or two passes over the data (sums in float64) plus scalar root
solves (:mod:`gradstat.stats.mle`); the Weibull MLE needs one pass per root-solver step.
Densities and distribution functions take and return float64 tensors.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy import special

from gradstat.errors import DataError, UsageError
from gradstat.stats import mle
from gradstat.stats.distribution_base import (
    METHODS,
    Distribution,
    Folded,
    Tails,
    check_spread,
    f64,
    mean_var,
)


class Exponential(Distribution):
    name, scipy_name, free = "exp", "expon", ("scale",)

    @classmethod
    def from_mean(cls, mean: float) -> Exponential:
        """The exponential with this mean (its MLE and moments fit)."""
        return cls(loc=0.0, scale=mean)

    @classmethod
    def _from_mean_var(cls, mean, var):
        return cls.from_mean(mean)

    def _logpdf(self, z):
        return -z

    def _cdf(self, z):
        return -torch.expm1(-z)

    def _sf(self, z):
        return torch.exp(-z)

    def _logsf(self, z):
        return -z

    def _ppf(self, q):
        return -torch.log1p(-q)

    def _isf(self, q):
        return -torch.log(q)


class Gamma(Distribution):
    name, scipy_name, free, closed = "gamma", "gamma", ("a", "scale"), False

    @classmethod
    def from_log_moments(cls, mean: float, mean_log: float) -> Gamma:
        """SIDCo's closed-form gamma (docs/methods.md 1): s = ln(mean) - mean(ln x),
        a = (3 - s + sqrt((s-3)^2 + 24 s)) / (12 s), scale = mean / a; an approximation
        of the MLE within ~1.5% in a."""
        s = math.log(mean) - mean_log
        if not s > 0:
            raise DataError("all values are equal: a gamma fit needs some spread")
        a = (3.0 - s + math.sqrt((s - 3.0) ** 2 + 24.0 * s)) / (12.0 * s)
        return cls(a=a, loc=0.0, scale=mean / a)

    @classmethod
    def _from_mean_var(cls, mean, var):
        check_spread(var, cls.name)
        return cls(a=mean * mean / var, loc=0.0, scale=var / mean)

    @classmethod
    def _fit_mle(cls, x):
        if bool((x <= 0).any()):
            raise DataError("a gamma MLE needs positive values")
        mean, var = mean_var(x)
        check_spread(var, cls.name)
        mean_log = float(torch.sum(x.log(), dtype=torch.float64)) / x.numel()
        # SIDCo's closed form starts Newton on ln a - digamma(a) = ln(mean) - mean_log
        start = cls.from_log_moments(mean, mean_log).params["a"]
        a = mle.gamma_shape(math.log(mean) - mean_log, start)
        return cls(a=a, loc=0.0, scale=mean / a)

    @property
    def _a(self) -> torch.Tensor:
        return f64(self.params["a"])

    def _logpdf(self, z):
        a = self.params["a"]
        return (a - 1.0) * torch.log(z) - z - math.lgamma(a)

    def _cdf(self, z):
        return torch.special.gammainc(self._a, z)

    def _sf(self, z):
        return torch.special.gammaincc(self._a, z)

    def _ppf(self, q):
        return f64(special.gammaincinv(self.params["a"], q.numpy()))

    def _isf(self, q):
        return f64(special.gammainccinv(self.params["a"], q.numpy()))


class GenPareto(Distribution):
    name, scipy_name, free = "gpd", "genpareto", ("c", "scale")

    @classmethod
    def from_moments(cls, mean: float, var: float) -> GenPareto:
        """Moments fit (docs/methods.md 1): c = (1 - m^2/v)/2, scale = m (m^2/v + 1)/2."""
        check_spread(var, cls.name)
        ratio = mean * mean / var
        return cls(c=(1.0 - ratio) / 2.0, loc=0.0, scale=mean * (ratio + 1.0) / 2.0)

    @classmethod
    def _from_mean_var(cls, mean, var):
        return cls.from_moments(mean, var)

    @classmethod
    def _fit_mle(cls, x):
        c, scale = mle.gpd(x.double().numpy())
        return cls(c=c, loc=0.0, scale=scale)

    @property
    def _c(self) -> float:
        return self.params["c"]

    def _logsf(self, z):
        """-ln(1 + c z) / c (-z as c -> 0); -inf past the upper end when c < 0."""
        if self._c == 0:
            return -z
        inside = 1.0 + self._c * z > 0
        return torch.where(inside, -torch.log1p(self._c * z) / self._c, -math.inf)

    def _logpdf(self, z):
        return (1.0 + self._c) * self._logsf(z)

    def _sf(self, z):
        return self._logsf(z).exp()

    def _cdf(self, z):
        return -torch.expm1(self._logsf(z))

    def _isf(self, q):
        log_q = torch.log(q)
        return -log_q if self._c == 0 else torch.expm1(-self._c * log_q) / self._c

    def _ppf(self, q):
        log_p = torch.log1p(-q)
        return -log_p if self._c == 0 else torch.expm1(-self._c * log_p) / self._c


class _GaussianTails:
    """cdf / sf and their logs through the standard normal of ``self._gauss(z)``: shared
    by the normal (the standard z itself) and the log-normal (ln z / s)."""

    def _cdf(self, z):
        return torch.special.log_ndtr(self._gauss(z)).exp()

    def _sf(self, z):
        return torch.special.log_ndtr(-self._gauss(z)).exp()

    def _logcdf(self, z):
        return torch.special.log_ndtr(self._gauss(z))

    def _logsf(self, z):
        return torch.special.log_ndtr(-self._gauss(z))


class Normal(_GaussianTails, Distribution):
    name, scipy_name, free, signed = "normal", "norm", ("loc", "scale"), True
    lower = -math.inf

    @classmethod
    def _from_mean_var(cls, mean, var):
        check_spread(var, cls.name)
        return cls(loc=mean, scale=math.sqrt(var))

    def _gauss(self, z):
        return z

    def _logpdf(self, z):
        return -0.5 * z * z - 0.5 * math.log(2.0 * math.pi)

    def _ppf(self, q):
        return torch.special.ndtri(q)

    def _isf(self, q):
        return -torch.special.ndtri(q)


class Laplace(Distribution):
    name, scipy_name, free, signed = "laplace", "laplace", ("loc", "scale"), True
    lower = -math.inf

    @classmethod
    def _from_mean_var(cls, mean, var):
        check_spread(var, cls.name)
        return cls(loc=mean, scale=math.sqrt(var / 2.0))

    @classmethod
    def _fit_mle(cls, x):
        x = x.double()
        loc = float(np.median(x.numpy()))
        scale = float((x - loc).abs().mean())
        check_spread(scale, cls.name)
        return cls(loc=loc, scale=scale)

    def _logpdf(self, z):
        return -z.abs() - math.log(2.0)

    def _logcdf(self, z):
        return torch.where(z < 0, z - math.log(2.0), torch.log1p(-0.5 * torch.exp(-z.abs())))

    def _logsf(self, z):
        return self._logcdf(-z)

    def _cdf(self, z):
        return self._logcdf(z).exp()

    def _sf(self, z):
        return self._logsf(z).exp()

    def _isf(self, q):
        return torch.where(q < 0.5, -torch.log(2.0 * q), torch.log(2.0 * (1.0 - q)))

    def _ppf(self, q):
        return -self._isf(q)


class LogNormal(_GaussianTails, Distribution):
    name, scipy_name, free, closed = "lognormal", "lognorm", ("s", "scale"), False

    @classmethod
    def _from_mean_var(cls, mean, var):
        check_spread(var, cls.name)
        s2 = math.log1p(var / (mean * mean))
        return cls(s=math.sqrt(s2), loc=0.0, scale=mean * math.exp(-s2 / 2.0))

    @classmethod
    def _fit_mle(cls, x):
        if bool((x <= 0).any()):
            raise DataError("a log-normal fit needs positive values")
        mu, s2 = mean_var(x.double().log())
        check_spread(s2, cls.name)
        return cls(s=math.sqrt(s2), loc=0.0, scale=math.exp(mu))

    def _gauss(self, z):
        return torch.log(z) / self.params["s"]

    def _logpdf(self, z):
        g = self._gauss(z)
        return -0.5 * g * g - torch.log(z) - math.log(self.params["s"] * math.sqrt(2.0 * math.pi))

    def _ppf(self, q):
        return torch.exp(self.params["s"] * torch.special.ndtri(q))

    def _isf(self, q):
        return torch.exp(-self.params["s"] * torch.special.ndtri(q))


def _weibull_cv2(c: float) -> float:
    """Squared coefficient of variation of a Weibull with shape c (decreasing in c)."""
    return math.expm1(special.gammaln(1.0 + 2.0 / c) - 2.0 * special.gammaln(1.0 + 1.0 / c))


class Weibull(Distribution):
    name, scipy_name, free, closed = "weibull", "weibull_min", ("c", "scale"), False

    @classmethod
    def _from_mean_var(cls, mean, var):
        check_spread(var, cls.name)
        cv2 = var / (mean * mean)
        c = mle.expand_root(lambda c: cv2 - _weibull_cv2(c), 0.1, 10.0)
        return cls(c=c, loc=0.0, scale=mean / math.exp(special.gammaln(1.0 + 1.0 / c)))

    @classmethod
    def _fit_mle(cls, x):
        if bool((x <= 0).any()):
            raise DataError("a Weibull MLE needs positive values")
        check_spread(mean_var(x)[1], cls.name)
        c, scale = mle.weibull(x.double().numpy())
        return cls(c=c, loc=0.0, scale=scale)

    def _logpdf(self, z):
        c = self.params["c"]
        return math.log(c) + (c - 1.0) * torch.log(z) - z**c

    def _logsf(self, z):
        return -(z ** self.params["c"])

    def _sf(self, z):
        return torch.exp(self._logsf(z))

    def _cdf(self, z):
        return -torch.expm1(self._logsf(z))

    def _ppf(self, q):
        return (-torch.log1p(-q)) ** (1.0 / self.params["c"])

    def _isf(self, q):
        return (-torch.log(q)) ** (1.0 / self.params["c"])


DISTRIBUTIONS: dict[str, type[Distribution]] = {
    cls.name: cls for cls in (GenPareto, Exponential, Gamma, Normal, Laplace, LogNormal, Weibull)
}


def get_distribution(name: str) -> type[Distribution]:
    """The distribution class called ``name`` (exp, gamma, gpd, ...)."""
    try:
        return DISTRIBUTIONS[name]
    except KeyError:
        raise UsageError(
            f"unknown distribution {name!r}; choose from {', '.join(DISTRIBUTIONS)} or all"
        ) from None


__all__ = [
    "DISTRIBUTIONS",
    "METHODS",
    "Distribution",
    "Exponential",
    "Folded",
    "Gamma",
    "GenPareto",
    "Laplace",
    "LogNormal",
    "Normal",
    "Tails",
    "Weibull",
    "get_distribution",
]
