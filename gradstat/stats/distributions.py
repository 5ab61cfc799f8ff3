"""Distributions of gradient values and their fits (METHODS.md 1).

The sparsity-inducing distributions model magnitudes x = |g| with the location fixed at
0: exponential, gamma and generalized Pareto (GPD), as in SIDCo (Abdelmoniem et al.
2021, arXiv 2101.10761); log-normal and Weibull are there for comparison. Normal and
Laplace model the signed values g. Exact zeros are excluded (and counted) before any fit;
NaN and Inf are counted and excluded (see :func:`split_values`).

Parameters are named and defined as in scipy.stats, so ``dist.to_scipy()`` (or
``getattr(scipy.stats, dist.scipy_name)(**dist.params)``) is the same distribution:

=========  ===============  =====================  ====================================
name       scipy.stats      params                 ``fit(method=...)``
=========  ===============  =====================  ====================================
exp        expon            loc=0, scale           both: scale = mean (MLE = moments)
gamma      gamma            a, loc=0, scale        moments: a = m^2/v; mle: Newton root
                                                   of ln a - digamma(a) = ln m - mean ln x
gpd        genpareto        c, loc=0, scale        moments: METHODS.md 1; mle: profile
                                                   likelihood (Grimshaw 1993) root solve
normal     norm             loc, scale             both: mean, std (ddof 0)
laplace    laplace          loc, scale             moments: mean, std/sqrt 2; mle: median,
                                                   mean |g - median|
lognormal  lognorm          s, loc=0, scale        moments: s^2 = ln(1 + v/m^2); mle: mean
                                                   and std of ln x
weibull    weibull_min      c, loc=0, scale        moments: root of the CV equation; mle:
                                                   root of the profile score in c
=========  ===============  =====================  ====================================

Every fit needs one or two passes over the data (sums in float64) plus scalar root
solves; the Weibull MLE needs one pass per root-solver step. Densities and distribution
functions take and return float64 tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from scipy import optimize, special

from gradstat.errors import DataError, UsageError

METHODS: tuple[str, ...] = ("moments", "mle")


@dataclass(frozen=True)
class SplitValues:
    """A vector split for fitting: finite non-zero signed values, their magnitudes, and
    the counts of what was left out."""

    signed: torch.Tensor
    magnitudes: torch.Tensor
    zeros: int
    nonfinite: int


def split_values(values: torch.Tensor) -> SplitValues:
    """Drop NaN/Inf and exact zeros from a flat vector, counting both."""
    flat = values.reshape(-1)
    finite = torch.isfinite(flat)
    nonfinite = flat.numel() - int(finite.sum())
    if nonfinite:
        flat = flat[finite]
    nonzero = flat != 0
    zeros = flat.numel() - int(nonzero.sum())
    if zeros:
        flat = flat[nonzero]
    return SplitValues(flat, flat.abs(), zeros, nonfinite)


def _f64(x) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.float64)


def _mean_var(x: torch.Tensor) -> tuple[float, float]:
    """Mean and population variance (ddof 0) with float64 accumulation."""
    if x.numel() == 0:
        raise DataError("no non-zero finite values to fit")
    mean = float(torch.sum(x, dtype=torch.float64)) / x.numel()
    shifted = x.double() - mean
    return mean, float(torch.dot(shifted, shifted)) / x.numel()


def _check_spread(var: float, name: str) -> None:
    if not var > 0:
        raise DataError(f"all values are equal: a {name} fit needs some spread")


class Distribution:
    """One fitted distribution. Subclasses set the class variables and the formulas."""

    name: ClassVar[str]
    scipy_name: ClassVar[str]
    #: True for distributions of the signed values g, False for magnitudes |g|.
    signed: ClassVar[bool] = False
    #: Free parameters (counted by AIC/BIC); a fixed ``loc`` = 0 is not one of them.
    free: ClassVar[tuple[str, ...]]

    def __init__(self, **params: float) -> None:
        self.params = {key: float(value) for key, value in params.items()}

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v:.6g}" for k, v in self.params.items())
        return f"{type(self).__name__}({inner})"

    @property
    def n_params(self) -> int:
        return len(self.free)

    def to_scipy(self):
        """The same distribution as a frozen scipy.stats object."""
        from scipy import stats

        return getattr(stats, self.scipy_name)(**self.params)

    @classmethod
    def fit(cls, x: torch.Tensor, method: str = "moments") -> Distribution:
        """Fit to ``x`` (signed values if ``signed``, else positive magnitudes)."""
        if method not in METHODS:
            raise UsageError(f"unknown fit method {method!r}; choose from {', '.join(METHODS)}")
        x = x.reshape(-1)
        if x.numel() < 2:
            raise DataError(f"a {cls.name} fit needs at least 2 non-zero values")
        return cls._fit_mle(x) if method == "mle" else cls._fit_moments(x)

    @classmethod
    def _fit_moments(cls, x: torch.Tensor) -> Distribution:
        raise NotImplementedError

    @classmethod
    def _fit_mle(cls, x: torch.Tensor) -> Distribution:
        return cls._fit_moments(x)

    # --- functions of the distribution (float64 tensors) --------------------------------
    def logpdf(self, x) -> torch.Tensor:
        raise NotImplementedError

    def cdf(self, x) -> torch.Tensor:
        raise NotImplementedError

    def sf(self, x) -> torch.Tensor:
        raise NotImplementedError

    def ppf(self, q) -> torch.Tensor:
        raise NotImplementedError

    def isf(self, q) -> torch.Tensor:
        raise NotImplementedError

    def pdf(self, x) -> torch.Tensor:
        return self.logpdf(x).exp()

    def logcdf(self, x) -> torch.Tensor:
        cdf, sf = self.cdf(x), self.sf(x)
        return torch.where(sf < 0.5, torch.log1p(-sf), cdf.log())

    def logsf(self, x) -> torch.Tensor:
        cdf, sf = self.cdf(x), self.sf(x)
        return torch.where(cdf < 0.5, torch.log1p(-cdf), sf.log())

    def loglik(self, x: torch.Tensor) -> float:
        """Log-likelihood of the data: sum of ``logpdf``."""
        return float(self.logpdf(x).sum())

    def magnitudes(self) -> Distribution | Folded:
        """The distribution of |G|: itself for magnitude models, folded for signed ones."""
        return Folded(self) if self.signed else self

    def magnitude_sf(self, t: float) -> float:
        """P(|G| > t): the fraction of elements a threshold t on magnitudes keeps."""
        return float(self.magnitudes().sf(t))

    def magnitude_isf(self, density: float) -> float:
        """The threshold t on |g| with P(|G| > t) = density (the upper quantile)."""
        if not self.signed:
            return float(self.isf(density))
        # P(|G| > t) falls from 1 at t = 0; past both one-sided quantiles at density/2 it
        # is at most density: bracket there and solve the scalar equation.
        high = max(float(self.isf(density / 2.0)), -float(self.ppf(density / 2.0)))
        return optimize.brentq(
            lambda t: self.magnitude_sf(t) - density, 0.0, high, xtol=1e-15 * high
        )


class Folded:
    """|G| for a signed distribution G: CDF F(t) - F(-t), density f(t) + f(-t) on t >= 0.

    Puts the normal and Laplace fits on the same footing as the magnitude models, so that
    KS, AD and log-likelihoods (AIC/BIC) of all seven are computed on the same |g|.
    """

    def __init__(self, dist: Distribution) -> None:
        self.dist = dist
        self.n_params = dist.n_params

    def sf(self, t) -> torch.Tensor:
        t = _f64(t).clamp_min(0)
        return self.dist.sf(t) + self.dist.cdf(-t)

    def cdf(self, t) -> torch.Tensor:
        t = _f64(t).clamp_min(0)
        return (self.dist.cdf(t) - self.dist.cdf(-t)).clamp_min(0)

    def logsf(self, t) -> torch.Tensor:
        t = _f64(t).clamp_min(0)
        return torch.logaddexp(self.dist.logsf(t), self.dist.logcdf(-t))

    def logcdf(self, t) -> torch.Tensor:
        sf = self.sf(t)
        return torch.where(sf < 0.5, torch.log1p(-sf), self.cdf(t).log())

    def logpdf(self, t) -> torch.Tensor:
        t = _f64(t)
        out = torch.logaddexp(self.dist.logpdf(t), self.dist.logpdf(-t))
        return torch.where(t >= 0, out, -math.inf)

    def loglik(self, t: torch.Tensor) -> float:
        return float(self.logpdf(t).sum())


class Exponential(Distribution):
    name, scipy_name, free = "exp", "expon", ("scale",)

    @classmethod
    def from_mean(cls, mean: float) -> Exponential:
        """The exponential with this mean (its MLE and moments fit)."""
        return cls(loc=0.0, scale=mean)

    @classmethod
    def _fit_moments(cls, x):
        return cls.from_mean(_mean_var(x)[0])

    @property
    def _scale(self) -> float:
        return self.params["scale"]

    def logpdf(self, x):
        x = _f64(x)
        out = -math.log(self._scale) - x / self._scale
        return torch.where(x >= 0, out, -math.inf)

    def cdf(self, x):
        return -torch.expm1(-_f64(x).clamp_min(0) / self._scale)

    def sf(self, x):
        return self.logsf(x).exp()

    def logsf(self, x):
        return -_f64(x).clamp_min(0) / self._scale

    def ppf(self, q):
        return -self._scale * torch.log1p(-_f64(q))

    def isf(self, q):
        return -self._scale * torch.log(_f64(q))


class Gamma(Distribution):
    name, scipy_name, free = "gamma", "gamma", ("a", "scale")

    @classmethod
    def from_log_moments(cls, mean: float, mean_log: float) -> Gamma:
        """SIDCo's closed-form gamma (METHODS.md 1): s = ln(mean) - mean(ln x),
        a = (3 - s + sqrt((s-3)^2 + 24 s)) / (12 s), scale = mean / a; an approximation
        of the MLE within ~1.5% in a."""
        s = math.log(mean) - mean_log
        if not s > 0:
            raise DataError("all values are equal: a gamma fit needs some spread")
        a = (3.0 - s + math.sqrt((s - 3.0) ** 2 + 24.0 * s)) / (12.0 * s)
        return cls(a=a, loc=0.0, scale=mean / a)

    @classmethod
    def _fit_moments(cls, x):
        mean, var = _mean_var(x)
        _check_spread(var, cls.name)
        return cls(a=mean * mean / var, loc=0.0, scale=var / mean)

    @classmethod
    def _fit_mle(cls, x):
        if bool((x <= 0).any()):
            raise DataError("a gamma MLE needs positive values")
        mean, var = _mean_var(x)
        _check_spread(var, cls.name)
        mean_log = float(torch.sum(x.log(), dtype=torch.float64)) / x.numel()
        s = math.log(mean) - mean_log
        # SIDCo's closed form (METHODS.md 1) starts Newton on ln a - digamma(a) = s.
        a = cls.from_log_moments(mean, mean_log).params["a"]
        for _ in range(50):
            step = (math.log(a) - special.digamma(a) - s) / (1.0 / a - special.polygamma(1, a))
            a = max(a - step, a / 10.0)
            if abs(step) < 1e-14 * a:
                break
        return cls(a=a, loc=0.0, scale=mean / a)

    def logpdf(self, x):
        x = _f64(x)
        a, scale = self.params["a"], self.params["scale"]
        out = (a - 1.0) * torch.log(x) - x / scale - math.lgamma(a) - a * math.log(scale)
        return torch.where(x > 0, out, -math.inf)

    def cdf(self, x):
        return torch.special.gammainc(_f64(self.params["a"]), _f64(x).clamp_min(0) / self._s)

    def sf(self, x):
        return torch.special.gammaincc(_f64(self.params["a"]), _f64(x).clamp_min(0) / self._s)

    @property
    def _s(self) -> float:
        return self.params["scale"]

    def ppf(self, q):
        return _f64(special.gammaincinv(self.params["a"], _f64(q).numpy())) * self._s

    def isf(self, q):
        return _f64(special.gammainccinv(self.params["a"], _f64(q).numpy())) * self._s


def _gpd_profile_mle(x: np.ndarray) -> tuple[float, float]:
    """GPD maximum likelihood (loc 0) by a 1-D root solve of the profile score.

    With theta = c / scale (Grimshaw 1993, Technometrics 35(2)), the likelihood is
    maximised over c for fixed theta by c(theta) = mean ln(1 + theta x), leaving the
    profile log-likelihood L(theta)/n = -ln(c/theta) - c - 1 on theta > -1/max(x). Its
    score S = 1/theta - r/c - r with r = mean x/(1 + theta x) has the MLE as root. The
    root is bracketed and found with Brent's method on a subsample, then polished by
    safeguarded Newton steps on all the data (each one pass: ln, r and mean r^2),
    usually two.
    """
    n = x.size
    if n < 2 or float(x.min()) < 0:
        raise DataError("a GPD MLE needs at least 2 non-negative values")
    lower = -1.0 / float(x.max())
    mean = float(x.mean())
    var = float(np.dot(x, x)) / n - mean * mean
    start = GenPareto.from_moments(mean, var).params
    theta = max(start["c"] / start["scale"], lower / 2.0) or 1e-3 / mean
    work, logs = np.empty_like(x), np.empty_like(x)

    def parts(theta: float, data: np.ndarray, buf: np.ndarray) -> tuple[float, float, float]:
        """c(theta) = mean ln(1 + theta x), r = mean x/(1 + theta x) and mean r^2."""
        theta = theta or 1e-9 / mean  # the score's removable singularity at 0
        np.multiply(data, theta, out=buf)
        c = float(np.log1p(buf, out=logs[: data.size]).mean())
        np.add(buf, 1.0, out=buf)
        np.divide(data, buf, out=buf)
        return c, float(buf.mean()), float(np.dot(buf, buf)) / data.size

    def score(theta: float, data: np.ndarray, buf: np.ndarray) -> float:
        c, r, _ = parts(theta, data, buf)
        return 1.0 / (theta or 1e-9 / mean) - r / c - r

    sub = x[:: max(1, n // 50_000)]
    sub_buf = np.empty_like(sub)
    sub_lower = -1.0 / float(sub.max())
    theta = max(theta, sub_lower / 2.0)
    step = max(abs(theta), 0.1 / mean)
    low = high = theta
    if score(theta, sub, sub_buf) > 0:
        for _ in range(200):
            high = low + step
            if score(high, sub, sub_buf) < 0:
                break
            low, step = high, step * 2.0
    else:
        for _ in range(200):
            low = max(high - step, (high + sub_lower) / 2.0)
            if score(low, sub, sub_buf) > 0:
                break
            high, step = low, step * 2.0
    if score(low, sub, sub_buf) > 0 > score(high, sub, sub_buf):
        theta = optimize.brentq(score, low, high, args=(sub, sub_buf), xtol=1e-12 / mean)
    if theta <= lower:
        theta = lower / 2.0
    for _ in range(30):
        c, r, r2 = parts(theta, x, work)
        s = 1.0 / theta - r / c - r
        # dS/dtheta with dc/dtheta = r and dr/dtheta = -r2
        ds = -1.0 / theta**2 + r2 / c + r * r / (c * c) + r2
        new = theta - s / ds if ds < 0 else theta + math.copysign(abs(theta) / 2.0, s)
        if new > lower and ds < 0 and abs(new - theta) <= 1e-5 * abs(theta):
            # Newton converges quadratically: a step of 1e-5 leaves ~1e-10 at the new point,
            # and c moves with it by dc/dtheta = r (the next term is ~r2 step^2 ~ 1e-10 c)
            c += r * (new - theta)
            theta = new
            break
        theta = new if new > lower else (theta + lower) / 2.0
    gpd_ll = -n * (math.log(c / theta) + c + 1.0)
    exp_ll = -n * (math.log(mean) + 1.0)  # the theta -> 0 limit: exponential
    if not gpd_ll >= exp_ll:
        return 0.0, mean
    return c, c / theta


class GenPareto(Distribution):
    name, scipy_name, free = "gpd", "genpareto", ("c", "scale")

    @classmethod
    def from_moments(cls, mean: float, var: float) -> GenPareto:
        """Moments fit (METHODS.md 1): c = (1 - m^2/v)/2, scale = m (m^2/v + 1)/2."""
        _check_spread(var, cls.name)
        ratio = mean * mean / var
        return cls(c=(1.0 - ratio) / 2.0, loc=0.0, scale=mean * (ratio + 1.0) / 2.0)

    @classmethod
    def _fit_moments(cls, x):
        return cls.from_moments(*_mean_var(x))

    @classmethod
    def _fit_mle(cls, x):
        c, scale = _gpd_profile_mle(x.double().numpy())
        return cls(c=c, loc=0.0, scale=scale)

    @property
    def _c(self) -> float:
        return self.params["c"]

    @property
    def _s(self) -> float:
        return self.params["scale"]

    def _z(self, x) -> torch.Tensor:
        """ln(1 + c x / scale) / c (the exponential's x/scale as c -> 0), +inf off support."""
        x = _f64(x).clamp_min(0) / self._s
        if self._c == 0:
            return x
        inside = 1.0 + self._c * x > 0
        z = torch.log1p(self._c * x) / self._c
        return torch.where(inside, z, math.inf)

    def logpdf(self, x):
        x = _f64(x)
        z = self._z(x)
        out = -math.log(self._s) - (1.0 + self._c) * z
        return torch.where((x >= 0) & torch.isfinite(z), out, -math.inf)

    def logsf(self, x):
        return -self._z(x)

    def sf(self, x):
        return self.logsf(x).exp()

    def cdf(self, x):
        return -torch.expm1(self.logsf(x))

    def isf(self, q):
        log_q = torch.log(_f64(q))
        if self._c == 0:
            return -self._s * log_q
        return self._s * torch.expm1(-self._c * log_q) / self._c

    def ppf(self, q):
        log_p = torch.log1p(-_f64(q))
        if self._c == 0:
            return -self._s * log_p
        return self._s * torch.expm1(-self._c * log_p) / self._c


class _GaussianTails:
    """cdf / sf and their logs through the standard normal of ``self._z(x)``: shared by
    the normal (z = (x - loc) / scale) and the log-normal (z = ln(x / scale) / s)."""

    def cdf(self, x):
        return torch.special.log_ndtr(self._z(x)).exp()

    def sf(self, x):
        return torch.special.log_ndtr(-self._z(x)).exp()

    def logcdf(self, x):
        return torch.special.log_ndtr(self._z(x))

    def logsf(self, x):
        return torch.special.log_ndtr(-self._z(x))


class Normal(_GaussianTails, Distribution):
    name, scipy_name, free, signed = "normal", "norm", ("loc", "scale"), True

    @classmethod
    def _fit_moments(cls, x):
        mean, var = _mean_var(x)
        _check_spread(var, cls.name)
        return cls(loc=mean, scale=math.sqrt(var))

    def _z(self, x) -> torch.Tensor:
        return (_f64(x) - self.params["loc"]) / self.params["scale"]

    def logpdf(self, x):
        z = self._z(x)
        return -0.5 * z * z - math.log(self.params["scale"]) - 0.5 * math.log(2.0 * math.pi)

    def ppf(self, q):
        return self.params["loc"] + self.params["scale"] * torch.special.ndtri(_f64(q))

    def isf(self, q):
        return self.params["loc"] - self.params["scale"] * torch.special.ndtri(_f64(q))


class Laplace(Distribution):
    name, scipy_name, free, signed = "laplace", "laplace", ("loc", "scale"), True

    @classmethod
    def _fit_moments(cls, x):
        mean, var = _mean_var(x)
        _check_spread(var, cls.name)
        return cls(loc=mean, scale=math.sqrt(var / 2.0))

    @classmethod
    def _fit_mle(cls, x):
        x = x.double()
        loc = float(np.median(x.numpy()))
        scale = float((x - loc).abs().mean())
        _check_spread(scale, cls.name)
        return cls(loc=loc, scale=scale)

    def _z(self, x) -> torch.Tensor:
        return (_f64(x) - self.params["loc"]) / self.params["scale"]

    def logpdf(self, x):
        return -self._z(x).abs() - math.log(2.0 * self.params["scale"])

    def logcdf(self, x):
        z = self._z(x)
        return torch.where(z < 0, z - math.log(2.0), torch.log1p(-0.5 * torch.exp(-z.abs())))

    def logsf(self, x):
        z = self._z(x)
        return torch.where(z > 0, -z - math.log(2.0), torch.log1p(-0.5 * torch.exp(-z.abs())))

    def cdf(self, x):
        return self.logcdf(x).exp()

    def sf(self, x):
        return self.logsf(x).exp()

    def isf(self, q):
        q = _f64(q)
        loc, scale = self.params["loc"], self.params["scale"]
        return torch.where(
            q < 0.5, loc - scale * torch.log(2.0 * q), loc + scale * torch.log(2.0 * (1.0 - q))
        )

    def ppf(self, q):
        return self.isf(1.0 - _f64(q))


class LogNormal(_GaussianTails, Distribution):
    name, scipy_name, free = "lognormal", "lognorm", ("s", "scale")

    @classmethod
    def _fit_moments(cls, x):
        mean, var = _mean_var(x)
        _check_spread(var, cls.name)
        s2 = math.log1p(var / (mean * mean))
        return cls(s=math.sqrt(s2), loc=0.0, scale=mean * math.exp(-s2 / 2.0))

    @classmethod
    def _fit_mle(cls, x):
        if bool((x <= 0).any()):
            raise DataError("a log-normal fit needs positive values")
        mu, s2 = _mean_var(x.double().log())
        _check_spread(s2, cls.name)
        return cls(s=math.sqrt(s2), loc=0.0, scale=math.exp(mu))

    def _z(self, x) -> torch.Tensor:
        return (torch.log(_f64(x)) - math.log(self.params["scale"])) / self.params["s"]

    def logpdf(self, x):
        x = _f64(x)
        z = self._z(x)
        out = -0.5 * z * z - torch.log(x) - math.log(self.params["s"] * math.sqrt(2.0 * math.pi))
        return torch.where(x > 0, out, -math.inf)

    def ppf(self, q):
        return self.params["scale"] * torch.exp(self.params["s"] * torch.special.ndtri(_f64(q)))

    def isf(self, q):
        return self.params["scale"] * torch.exp(-self.params["s"] * torch.special.ndtri(_f64(q)))


def _weibull_cv2(c: float) -> float:
    """Squared coefficient of variation of a Weibull with shape c (decreasing in c)."""
    return math.expm1(special.gammaln(1.0 + 2.0 / c) - 2.0 * special.gammaln(1.0 + 1.0 / c))


def _expand_root(f, low: float, high: float) -> float:
    """Root of an increasing f: widen [low, high] geometrically until it brackets one."""
    for _ in range(60):
        if f(low) < 0 < f(high):
            return optimize.brentq(f, low, high, xtol=1e-14, rtol=1e-14)
        low, high = low / 2.0, high * 2.0
    raise DataError("the fit equation has no root: the data do not fit this distribution")


class Weibull(Distribution):
    name, scipy_name, free = "weibull", "weibull_min", ("c", "scale")

    @classmethod
    def _fit_moments(cls, x):
        mean, var = _mean_var(x)
        _check_spread(var, cls.name)
        cv2 = var / (mean * mean)
        c = _expand_root(lambda c: cv2 - _weibull_cv2(c), 0.1, 10.0)
        return cls(c=c, loc=0.0, scale=mean / math.exp(special.gammaln(1.0 + 1.0 / c)))

    @classmethod
    def _fit_mle(cls, x):
        if bool((x <= 0).any()):
            raise DataError("a Weibull MLE needs positive values")
        log_x = x.double().log().numpy()
        _, var = _mean_var(x)
        _check_spread(var, cls.name)
        top, mean_log = float(log_x.max()), float(log_x.mean())
        shifted = log_x - top
        buf = np.empty_like(shifted)

        def score(c: float) -> float:
            # sum x^c ln x / sum x^c - 1/c - mean ln x, with x^c scaled by max(x)^-c
            np.multiply(shifted, c, out=buf)
            np.exp(buf, out=buf)
            return float(np.dot(buf, log_x) / buf.sum()) - 1.0 / c - mean_log

        c = _expand_root(score, 0.1, 10.0)
        np.exp(shifted * c, out=buf)
        scale = math.exp(top + math.log(float(buf.mean())) / c)
        return cls(c=c, loc=0.0, scale=scale)

    def _z(self, x) -> torch.Tensor:
        return (_f64(x).clamp_min(0) / self.params["scale"]) ** self.params["c"]

    def logpdf(self, x):
        x = _f64(x)
        c, scale = self.params["c"], self.params["scale"]
        out = math.log(c / scale) + (c - 1.0) * torch.log(x / scale) - (x / scale) ** c
        return torch.where(x > 0, out, -math.inf)

    def logsf(self, x):
        return -self._z(x)

    def sf(self, x):
        return torch.exp(-self._z(x))

    def cdf(self, x):
        return -torch.expm1(-self._z(x))

    def ppf(self, q):
        return self.params["scale"] * (-torch.log1p(-_f64(q))) ** (1.0 / self.params["c"])

    def isf(self, q):
        return self.params["scale"] * (-torch.log(_f64(q))) ** (1.0 / self.params["c"])


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
