"""The base of gradstat's distributions (:mod:`gradstat.stats.distributions` holds the
families and the registry): :class:`Distribution` in scipy.stats' ``rv_continuous`` shape,
:class:`Folded` (|G| of a signed model), and the float64 moment pass the fits share."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from scipy import optimize

from gradstat.errors import DataError, UsageError

METHODS: tuple[str, ...] = ("moments", "mle")


@dataclass(frozen=True)
class Tails:
    """CDF, log-CDF and log-SF of the same values (:meth:`Distribution.sorted_tails`)."""

    cdf: torch.Tensor
    logcdf: torch.Tensor
    logsf: torch.Tensor


def f64(x) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.float64)


#: Elements per chunk of the CPU moment passes (2 MiB of float64 temporaries).
_MOMENT_CHUNK = 1 << 18


def mean_var(x: torch.Tensor) -> tuple[float, float]:
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


def check_spread(var: float, name: str) -> None:
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
        return cls._from_mean_var(*mean_var(x))

    @classmethod
    def _from_mean_var(cls, mean: float, var: float) -> Distribution:
        raise NotImplementedError

    @classmethod
    def _fit_mle(cls, x: torch.Tensor) -> Distribution:
        return cls._fit_moments(x)

    # --- public functions: standardise once, then the standard form --------------------
    def _z(self, x) -> torch.Tensor:
        return (f64(x) - self.loc) / self.scale

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
        return self.loc + self.scale * self._ppf(f64(q))

    def isf(self, q) -> torch.Tensor:
        return self.loc + self.scale * self._isf(f64(q))

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
        split = int(torch.searchsorted(z, self._ppf(f64([0.5]))))
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
        return f64([self._isf_scalar(float(p)) for p in q.reshape(-1)]).reshape(q.shape)

    def _ppf(self, q):
        return self._isf(1.0 - q)

    def _isf_scalar(self, density: float) -> float:
        # P(|G| > t) falls from 1 at t = 0; past both one-sided quantiles at density/2 it
        # is at most density: bracket there and solve the scalar equation.
        dist = self.dist
        high = max(float(dist.isf(density / 2.0)), -float(dist.ppf(density / 2.0)))
        return optimize.brentq(
            lambda t: float(self._sf(f64(t))) - density, 0.0, high, xtol=1e-15 * high
        )
