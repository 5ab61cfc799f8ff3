"""Maximum-likelihood solvers of the distributions without a closed-form MLE
(docs/methods.md section 1).

Each takes float64 data and returns the fitted parameters as floats; the distribution
classes in :mod:`gradstat.stats.distributions` wrap them. Every solver reduces the fit
to a scalar root solve, one or two passes over the data per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from scipy import optimize, special

from gradstat.errors import DataError

#: Brent's bracketing runs on at most this many values (a strided subsample); Newton
#: polishes the root on all of them.
_BRACKET_SAMPLE = 50_000


def gamma_shape(s: float, start: float) -> float:
    """The gamma MLE shape a: Newton's root of ln a - digamma(a) = s, with
    s = ln(mean) - mean(ln x) > 0, started from ``start`` (SIDCo's closed form)."""
    a = start
    for _ in range(50):
        step = (math.log(a) - special.digamma(a) - s) / (1.0 / a - special.polygamma(1, a))
        a = max(a - step, a / 10.0)
        if abs(step) < 1e-14 * a:
            break
    return a


def expand_root(f: Callable[[float], float], low: float, high: float) -> float:
    """Root of an increasing f: widen [low, high] geometrically until it brackets one."""
    for _ in range(60):
        if f(low) < 0 < f(high):
            return optimize.brentq(f, low, high, xtol=1e-14, rtol=1e-14)
        low, high = low / 2.0, high * 2.0
    raise DataError("the fit equation has no root: the data do not fit this distribution")


def weibull(x: np.ndarray) -> tuple[float, float]:
    """Weibull MLE (c, scale) of positive x: the root in c of the profile score
    sum x^c ln x / sum x^c - 1/c - mean ln x, then scale = (mean x^c)^(1/c)."""
    log_x = np.log(x)
    top, mean_log = float(log_x.max()), float(log_x.mean())
    shifted = log_x - top
    buf = np.empty_like(shifted)

    def score(c: float) -> float:
        # x^c scaled by max(x)^-c so that no power overflows
        np.multiply(shifted, c, out=buf)
        np.exp(buf, out=buf)
        return float(np.dot(buf, log_x) / buf.sum()) - 1.0 / c - mean_log

    c = expand_root(score, 0.1, 10.0)
    np.exp(shifted * c, out=buf)
    return c, math.exp(top + math.log(float(buf.mean())) / c)


def _moments_start(x: np.ndarray, mean: float) -> tuple[float, float]:
    """The GPD's moments fit (c, scale) with loc 0: the root search's start."""
    var = float(np.dot(x, x)) / x.size - mean * mean
    if not var > 0:
        raise DataError("all values are equal: a gpd fit needs some spread")
    ratio = mean * mean / var
    return (1.0 - ratio) / 2.0, mean * (ratio + 1.0) / 2.0


def _bracket(score, theta: float, step: float, lower: float) -> tuple[float, float]:
    """``(low, high)`` around the profile score's root (``score(low) > 0 > score(high)``
    where one was found in 200 doublings of ``step``), from ``theta``, above ``lower``."""
    low = high = theta
    if score(theta) > 0:
        for _ in range(200):
            high = low + step
            if score(high) < 0:
                break
            low, step = high, step * 2.0
    else:
        for _ in range(200):
            low = max(high - step, (high + lower) / 2.0)
            if score(low) > 0:
                break
            high, step = low, step * 2.0
    return low, high


def _newton(parts, theta: float, lower: float) -> tuple[float, float]:
    """``(c, theta)`` after safeguarded Newton steps on the profile score over all the
    data (``parts(theta)``: c, r and mean r^2), at most 30, staying above ``lower``."""
    for _ in range(30):
        c, r, r2 = parts(theta)
        s = 1.0 / theta - r / c - r
        # dS/dtheta with dc/dtheta = r and dr/dtheta = -r2
        ds = -1.0 / theta**2 + r2 / c + r * r / (c * c) + r2
        new = theta - s / ds if ds < 0 else theta + math.copysign(abs(theta) / 2.0, s)
        if new > lower and ds < 0 and abs(new - theta) <= 1e-5 * abs(theta):
            # Newton converges quadratically: a step of 1e-5 leaves ~1e-10 at the new point,
            # and c moves with it by dc/dtheta = r (the next term is ~r2 step^2 ~ 1e-10 c)
            return c + r * (new - theta), new
        theta = new if new > lower else (theta + lower) / 2.0
    return c, theta


def gpd(x: np.ndarray, start: tuple[float, float] | None = None) -> tuple[float, float]:
    """GPD maximum likelihood (c, scale) with loc 0 by a 1-D root solve of the profile score.

    With theta = c / scale (Grimshaw 1993, Technometrics 35(2)), the likelihood is
    maximised over c for fixed theta by c(theta) = mean ln(1 + theta x), leaving the
    profile log-likelihood L(theta)/n = -ln(c/theta) - c - 1 on theta > -1/max(x). Its
    score S = 1/theta - r/c - r with r = mean x/(1 + theta x) has the MLE as root. The
    root is bracketed from ``start`` (c, scale) (default: the moments fit) and found with
    Brent's method on a subsample, then polished by safeguarded Newton steps on all the
    data (each one pass: ln, r and mean r^2), usually two; a warm start (the previous
    SIDCo stage's fit) keeps the bracket short."""
    n = x.size
    if n < 2 or float(x.min()) < 0:
        raise DataError("a GPD MLE needs at least 2 non-negative values")
    lower = -1.0 / float(x.max())
    mean = float(x.mean())
    start = start or _moments_start(x, mean)
    theta = max(start[0] / start[1], lower / 2.0) or 1e-3 / mean
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

    sub = x[:: max(1, n // _BRACKET_SAMPLE)]
    sub_buf = np.empty_like(sub)
    sub_lower = -1.0 / float(sub.max())
    theta = max(theta, sub_lower / 2.0)
    low, high = _bracket(
        lambda t: score(t, sub, sub_buf), theta, max(abs(theta) / 8.0, 0.01 / mean), sub_lower
    )
    if score(low, sub, sub_buf) > 0 > score(high, sub, sub_buf):
        theta = optimize.brentq(score, low, high, args=(sub, sub_buf), xtol=1e-12 / mean)
    if theta <= lower:
        theta = lower / 2.0
    c, theta = _newton(lambda t: parts(t, x, work), theta, lower)
    gpd_ll = -n * (math.log(c / theta) + c + 1.0)
    exp_ll = -n * (math.log(mean) + 1.0)  # the theta -> 0 limit: exponential
    if not gpd_ll >= exp_ll:
        return 0.0, mean
    return c, c / theta
