"""Distributions of gradient values and their fits (docs/methods.md section 1).

The sparsity-inducing distributions model magnitudes x = |g| with the location fixed at
0: exponential, gamma and generalized Pareto (GPD), as in SIDCo (Abdelmoniem et al.
2021, arXiv 2101.10761); log-normal and Weibull are there for comparison. Normal and
Laplace model the signed values g; :class:`Folded` turns them into distributions of |g|.
Exact zeros are excluded (and counted) before any fit; NaN and Inf are counted and
excluded (see :func:`split_values`).

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
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from scipy import optimize, special

from gradstat.errors import DataError, UsageError
from gradstat.stats import mle
from gradstat.stats.passes import compress, compress_in_place, drop_zeros_in_place

METHODS: tuple[str, ...] = ("moments", "mle")


class SplitValues:
    """A vector split for fitting: the magnitudes of its finite non-zero values, the
    counts of what was left out, and those values themselves, signed (:attr:`signed`).

    Only the signed distributions (normal, Laplace) need the signed values, so they are
    compacted when first asked for: a magnitude fit of a row that holds a zero keeps two
    rows (the row and its non-zero magnitudes) instead of three (512 MB less at 128M
    values)."""

    def __init__(
        self, source: torch.Tensor, magnitudes: torch.Tensor, zeros: int, nonfinite: int
    ) -> None:
        self.source = source.reshape(-1)
        self.magnitudes = magnitudes
        self.zeros = zeros
        self.nonfinite = nonfinite
        self._signed: torch.Tensor | None = None

    @property
    def count(self) -> int:
        """How many finite non-zero values the vector holds."""
        return self.magnitudes.numel()

    @property
    def signed(self) -> torch.Tensor:
        """The finite non-zero values, signed, in the vector's order."""
        if self._signed is None:
            if self.zeros or self.nonfinite:
                keep = torch.isfinite(self.source) & (self.source != 0)
                self._signed = compress(self.source, keep)
            else:
                self._signed = self.source
        return self._signed


def split_values(values: torch.Tensor, out: torch.Tensor | None = None) -> SplitValues:
    """Drop NaN/Inf and exact zeros from a flat vector, counting both. (A finite sum
    means every value is finite, and a non-zero minimum |x| that none is zero: the
    usual gradient costs a sum, an abs and a minimum.) ``out``: a flat buffer of at least
    ``values.numel()`` elements on the same device for the magnitudes, reused from row to
    row (a fresh 128 MB vector that the allocator had handed back to the kernel cost 0.17
    s of page faults, the abs itself 0.02 s)."""
    flat = values.reshape(-1)
    # compacted in place below: a fresh vector, or the caller's buffer
    magnitudes = flat.abs() if out is None else torch.abs(flat, out=out[: flat.numel()])
    nonfinite = 0
    if not bool(torch.isfinite(flat.sum())):
        finite = torch.isfinite(magnitudes)
        nonfinite = flat.numel() - int(torch.count_nonzero(finite))
        if nonfinite:
            magnitudes = compress_in_place(magnitudes, finite)
    zeros = 0
    if magnitudes.numel() and not float(magnitudes.amin()) > 0:
        magnitudes, zeros = drop_zeros_in_place(magnitudes)
    return SplitValues(flat, magnitudes, zeros, nonfinite)


@dataclass(frozen=True)
class Tails:
    """CDF, log-CDF and log-SF of the same values (:meth:`Distribution.sorted_tails`)."""

    cdf: torch.Tensor
    logcdf: torch.Tensor
    logsf: torch.Tensor


def _f64(x) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.float64)


#: Elements per chunk of the CPU moment passes (2 MiB of float64 temporaries).
_MOMENT_CHUNK = 1 << 18


def _mean_var(x: torch.Tensor) -> tuple[float, float]:
    """Mean and population variance (ddof 0) with float64 accumulation. On the CPU one
    pass in chunks through numpy: each chunk's float64 mean and sum of squared deviations
    from it (no cancellation), merged as Chan, Golub & LeVeque (1983) do; no float64 copy
    of the vector (32M values: 36 ms, 76 ms for two passes)."""
    if x.numel() == 0:
        raise DataError("no non-zero finite values to fit")
    if x.device.type != "cpu":
        mean = float(torch.sum(x, dtype=torch.float64)) / x.numel()
        shifted = x.double() - mean
        return mean, float(torch.dot(shifted, shifted)) / x.numel()
    flat = x.reshape(-1).numpy()
    scratch = np.empty(min(flat.size, _MOMENT_CHUNK))
    n, mean, squares = 0, 0.0, 0.0
    for i in range(0, flat.size, _MOMENT_CHUNK):
        part = scratch[: flat[i : i + _MOMENT_CHUNK].size]
        np.copyto(part, flat[i : i + _MOMENT_CHUNK])  # widened to float64
        m = part.size
        part_mean = float(np.add.reduce(part)) / m
        part -= part_mean
        part_squares = float(np.einsum("i,i->", part, part))  # not BLAS: no threads started
        delta = part_mean - mean
        total = n + m
        mean += delta * m / total
        squares += part_squares + delta * delta * n * m / total
        n = total
    return mean, squares / n


def _check_spread(var: float, name: str) -> None:
    if not var > 0:
        raise DataError(f"all values are equal: a {name} fit needs some spread")


class Distribution:
    """One distribution with its parameters (scipy's names), in scipy.stats' shape.

    Subclasses set the class variables, the standard-form functions of
    ``z = (x - loc) / scale`` and the fits. ``lower`` is where the standard support
    starts (``-inf`` for signed models); ``closed``: whether it includes ``lower``.
    """

    name: ClassVar[str]
    scipy_name: ClassVar[str]
    #: True for distributions of the signed values g, False for magnitudes |g|.
    signed: ClassVar[bool] = False
    #: Free parameters (counted by AIC/BIC); a fixed ``loc`` = 0 is not one of them.
    free: ClassVar[tuple[str, ...]]
    lower: ClassVar[float] = 0.0
    closed: ClassVar[bool] = True

    def __init__(self, **params: float) -> None:
        self.params = {key: float(value) for key, value in params.items()}
        self.loc = self.params.get("loc", 0.0)
        self.scale = self.params.get("scale", 1.0)

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

    # --- fits -----------------------------------------------------------------------------
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
    def fit_from_moments(cls, n: int, mean: float, var: float) -> Distribution:
        """The moments fit from the count, mean and variance (ddof 0) of the values it
        fits (signed if ``signed``, else magnitudes): what :meth:`fit` computes from them."""
        if n < 2:
            raise DataError(f"a {cls.name} fit needs at least 2 non-zero values")
        return cls._from_mean_var(mean, var)

    @classmethod
    def _fit_moments(cls, x: torch.Tensor) -> Distribution:
        return cls._from_mean_var(*_mean_var(x))

    @classmethod
    def _from_mean_var(cls, mean: float, var: float) -> Distribution:
        raise NotImplementedError

    @classmethod
    def _fit_mle(cls, x: torch.Tensor) -> Distribution:
        return cls._fit_moments(x)

    # --- public functions: standardise once, then the standard form --------------------
    def _z(self, x) -> torch.Tensor:
        return (_f64(x) - self.loc) / self.scale

    def logpdf(self, x) -> torch.Tensor:
        z = self._z(x)
        inside = z >= self.lower if self.closed else z > self.lower
        return torch.where(inside, self._logpdf(z) - math.log(self.scale), -math.inf)

    def pdf(self, x) -> torch.Tensor:
        return self.logpdf(x).exp()

    def cdf(self, x) -> torch.Tensor:
        return self._cdf(self._z(x).clamp_min(self.lower))

    def sf(self, x) -> torch.Tensor:
        return self._sf(self._z(x).clamp_min(self.lower))

    def logcdf(self, x) -> torch.Tensor:
        return self._logcdf(self._z(x).clamp_min(self.lower))

    def logsf(self, x) -> torch.Tensor:
        return self._logsf(self._z(x).clamp_min(self.lower))

    def ppf(self, q) -> torch.Tensor:
        return self.loc + self.scale * self._ppf(_f64(q))

    def isf(self, q) -> torch.Tensor:
        return self.loc + self.scale * self._isf(_f64(q))

    def loglik(self, x: torch.Tensor) -> float:
        """Log-likelihood of the data: sum of ``logpdf``."""
        return float(self.logpdf(x).sum())

    def sorted_tails(self, x: torch.Tensor) -> Tails:
        """CDF, log-CDF and log-SF of ascending ``x`` for goodness-of-fit scores, each
        element evaluated once, on the side where it is accurate: the CDF (or its
        closed-form log) below the median, the SF above it; the other side follows as
        ``log1p(-p)``, exact to rounding where ``p <= 1/2``. Half of what ``cdf``,
        ``logcdf`` and ``logsf`` cost one after another (each of which may evaluate
        both sides on every element)."""
        z = self._z(x).clamp_min(self.lower)  # ascending: scale > 0
        split = int(torch.searchsorted(z, self._ppf(_f64([0.5]))))
        low, high = z[:split], z[split:]
        logcdf_low = self._lower_log(low)
        logsf_high = self._upper_log(high)
        cdf = torch.cat([logcdf_low.exp(), -torch.expm1(logsf_high)])
        logcdf = torch.cat([logcdf_low, torch.log1p(-logsf_high.exp())])
        logsf = torch.cat([torch.log1p(-logcdf_low.exp()), logsf_high])
        return Tails(cdf, logcdf, logsf)

    def _lower_log(self, z: torch.Tensor) -> torch.Tensor:
        """log F(z) where F(z) <= 1/2: the closed form where the subclass has one."""
        if type(self)._logcdf is Distribution._logcdf:
            return self._cdf(z).log()
        return self._logcdf(z)

    def _upper_log(self, z: torch.Tensor) -> torch.Tensor:
        """log S(z) where S(z) <= 1/2: the closed form where the subclass has one."""
        if type(self)._logsf is Distribution._logsf:
            return self._sf(z).log()
        return self._logsf(z)

    # --- standard form: subclasses write _logpdf, _cdf, _ppf (and more for precision) ---
    def _logpdf(self, z: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _cdf(self, z: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _ppf(self, q: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _sf(self, z: torch.Tensor) -> torch.Tensor:
        return 1.0 - self._cdf(z)

    def _isf(self, q: torch.Tensor) -> torch.Tensor:
        return self._ppf(1.0 - q)

    def _logcdf(self, z: torch.Tensor) -> torch.Tensor:
        cdf, sf = self._cdf(z), self._sf(z)
        return torch.where(sf < 0.5, torch.log1p(-sf), cdf.log())

    def _logsf(self, z: torch.Tensor) -> torch.Tensor:
        cdf, sf = self._cdf(z), self._sf(z)
        return torch.where(cdf < 0.5, torch.log1p(-cdf), sf.log())

    # --- magnitudes ----------------------------------------------------------------------
    def magnitudes(self) -> Distribution:
        """The distribution of |G|: itself for magnitude models, folded for signed ones."""
        return Folded(self) if self.signed else self

    def magnitude_sf(self, t: float) -> float:
        """P(|G| > t): the fraction of elements a threshold t on magnitudes keeps."""
        return float(self.magnitudes().sf(t))

    def magnitude_isf(self, density: float) -> float:
        """The threshold t on |g| with P(|G| > t) = density (the upper quantile)."""
        return float(self.magnitudes().isf(density))


class Folded(Distribution):
    """|G| for a signed distribution G: CDF F(t) - F(-t), density f(t) + f(-t) on t >= 0.

    Puts the normal and Laplace fits on the same footing as the magnitude models, so that
    KS, AD and log-likelihoods (AIC/BIC) of all seven are computed on the same |g|. Its
    functions are those of G at +-t (no standardisation of its own); its upper quantile
    is a scalar root solve.
    """

    def __init__(self, dist: Distribution) -> None:
        super().__init__(loc=0.0, scale=1.0)
        self.dist = dist
        self.params = dict(dist.params)
        self.name = f"folded {dist.name}"
        self.free = dist.free

    def to_scipy(self):
        raise NotImplementedError("scipy.stats has no folded form of every signed model")

    def _logpdf(self, t):
        return torch.logaddexp(self.dist.logpdf(t), self.dist.logpdf(-t))

    def _cdf(self, t):
        return (self.dist.cdf(t) - self.dist.cdf(-t)).clamp_min(0)

    def _sf(self, t):
        return (self.dist.sf(t) + self.dist.cdf(-t)).clamp_max(1.0)

    def _logsf(self, t):
        return torch.logaddexp(self.dist.logsf(t), self.dist.logcdf(-t)).clamp_max(0.0)

    def _isf(self, q):
        return _f64([self._isf_scalar(float(p)) for p in q.reshape(-1)]).reshape(q.shape)

    def _ppf(self, q):
        return self._isf(1.0 - q)

    def _isf_scalar(self, density: float) -> float:
        # P(|G| > t) falls from 1 at t = 0; past both one-sided quantiles at density/2 it
        # is at most density: bracket there and solve the scalar equation.
        dist = self.dist
        high = max(float(dist.isf(density / 2.0)), -float(dist.ppf(density / 2.0)))
        return optimize.brentq(
            lambda t: float(self._sf(_f64(t))) - density, 0.0, high, xtol=1e-15 * high
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
        _check_spread(var, cls.name)
        return cls(a=mean * mean / var, loc=0.0, scale=var / mean)

    @classmethod
    def _fit_mle(cls, x):
        if bool((x <= 0).any()):
            raise DataError("a gamma MLE needs positive values")
        mean, var = _mean_var(x)
        _check_spread(var, cls.name)
        mean_log = float(torch.sum(x.log(), dtype=torch.float64)) / x.numel()
        # SIDCo's closed form starts Newton on ln a - digamma(a) = ln(mean) - mean_log
        start = cls.from_log_moments(mean, mean_log).params["a"]
        a = mle.gamma_shape(math.log(mean) - mean_log, start)
        return cls(a=a, loc=0.0, scale=mean / a)

    @property
    def _a(self) -> torch.Tensor:
        return _f64(self.params["a"])

    def _logpdf(self, z):
        a = self.params["a"]
        return (a - 1.0) * torch.log(z) - z - math.lgamma(a)

    def _cdf(self, z):
        return torch.special.gammainc(self._a, z)

    def _sf(self, z):
        return torch.special.gammaincc(self._a, z)

    def _ppf(self, q):
        return _f64(special.gammaincinv(self.params["a"], q.numpy()))

    def _isf(self, q):
        return _f64(special.gammainccinv(self.params["a"], q.numpy()))


class GenPareto(Distribution):
    name, scipy_name, free = "gpd", "genpareto", ("c", "scale")

    @classmethod
    def from_moments(cls, mean: float, var: float) -> GenPareto:
        """Moments fit (docs/methods.md 1): c = (1 - m^2/v)/2, scale = m (m^2/v + 1)/2."""
        _check_spread(var, cls.name)
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
        _check_spread(var, cls.name)
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
        _check_spread(var, cls.name)
        return cls(loc=mean, scale=math.sqrt(var / 2.0))

    @classmethod
    def _fit_mle(cls, x):
        x = x.double()
        loc = float(np.median(x.numpy()))
        scale = float((x - loc).abs().mean())
        _check_spread(scale, cls.name)
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
        _check_spread(var, cls.name)
        cv2 = var / (mean * mean)
        c = mle.expand_root(lambda c: cv2 - _weibull_cv2(c), 0.1, 10.0)
        return cls(c=c, loc=0.0, scale=mean / math.exp(special.gammaln(1.0 + 1.0 / c)))

    @classmethod
    def _fit_mle(cls, x):
        if bool((x <= 0).any()):
            raise DataError("a Weibull MLE needs positive values")
        _check_spread(_mean_var(x)[1], cls.name)
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
