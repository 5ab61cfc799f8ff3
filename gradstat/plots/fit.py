"""Figure of ``gradstat fit`` for one (step, learner, scope): how well each fitted
distribution describes |g| and where the thresholds at each ratio fall.

Panels: the histogram of |g| on log-spaced bins (as the density of ln|g|) with the
fitted densities; the log-log complementary CDF of the upper half of |g| (the tail the
thresholds are read from) with the fitted tails, the empirical top-k threshold at each
ratio (dashed, labelled at the top) and each distribution's fitted threshold (open
circles); one Q-Q plot per distribution (fitted against empirical quantiles, log-log,
with the diagonal; quantiles off the scale counted in a note).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from gradstat.plots.style import new_figure, plain_log_axis
from gradstat.stats.distributions import Distribution, get_distribution


def _fitted(records: pd.DataFrame) -> dict[str, Distribution]:
    fits = records[(records["kind"] == "fit") & records["error"].isna()]
    first = fits.drop_duplicates("dist")
    return {
        row.dist: get_distribution(row.dist)(**row.params) for row in first.itertuples(index=False)
    }


#: The x axes start where the histogram of ln|g| first reaches this share of its peak,
#: so a few values near zero do not stretch them over decades where nothing else is.
VISIBLE = 0.005


def _visible_low(x: np.ndarray) -> float:
    """The smallest |g| where the density of ln|g| is visible on a linear axis."""
    edges = np.geomspace(x[0], x[-1], 200)
    counts, _ = np.histogram(x, bins=edges)
    heights = counts / np.diff(np.log(edges))
    return float(edges[np.argmax(heights >= VISIBLE * heights.max())])


#: Colour (an index into seaborn's colorblind palette) and line style of each
#: distribution: exp and normal, laplace and weibull, neighbours in the palette's order,
#: differ in hue and in dash.
DIST_STYLES = {
    "gpd": (0, "-"),
    "exp": (1, "--"),
    "gamma": (2, "-."),
    "normal": (7, ":"),
    "laplace": (4, "--"),
    "lognormal": (5, "-."),
    "weibull": (9, (0, (5, 1, 1, 1, 1, 1))),
}


def dist_style(name: str, index: int) -> dict:
    """``color`` and ``ls`` of distribution ``name`` (the ``index``-th drawn) in a figure."""
    palette = sns.color_palette("colorblind", 10).as_hex()
    color, ls = DIST_STYLES.get(name, (index % 10, "-"))
    return {"color": palette[color], "ls": ls}


def _grid(panels: int, ncols: int = 3) -> tuple[int, int]:
    return math.ceil(panels / ncols), ncols


def plot_fit(records: pd.DataFrame, magnitudes: np.ndarray, title: str) -> Figure:
    """Draw the fit figure from the records of one (step, learner, scope) and a sample of
    its non-zero magnitudes.

    Panels fill a 3-column grid (histogram, CCDF, one Q-Q per distribution); the legend
    takes the first free cell, or sits below the grid when there is none, so it never
    covers data. The x axes start where the density of ln|g| becomes visible.
    """
    dists = _fitted(records)
    panels = 2 + len(dists)
    nrows, ncols = _grid(panels)
    fig, axes = new_figure(nrows, ncols, width=4.2, height=3.4)
    cells = list(axes.flat)
    x = np.sort(magnitudes)
    low, high = _visible_low(x), float(x[-1])
    grid = np.geomspace(low, high, 400)
    colors = {name: dist_style(name, i) for i, name in enumerate(dists)}
    _histogram(cells[0], x, (low, high), grid, dists, colors)
    fits = records[(records["kind"] == "fit") & records["error"].isna()]
    _tail(cells[1], x, grid, dists, colors, fits)
    _quantiles(cells[2:], x, dists, colors)
    _legend(fig, cells[0], cells[1], cells[panels:])
    fig.suptitle(title)
    return fig


def _histogram(ax, x: np.ndarray, span: tuple[float, float], grid, dists, colors) -> None:
    """The density of ln|g| (x f(x)) of the sorted sample ``x`` on log-spaced bins over
    ``span`` (the shape of the bulk stays readable), with each fitted density."""
    low, high = span
    edges = np.geomspace(low, high, 80)
    counts, _ = np.histogram(x, bins=edges)
    heights = counts / (x.size * np.diff(np.log(edges)))
    ax.stairs(heights, edges, fill=True, color="0.8", label="|g| (histogram)")
    peak = heights.max()
    for name, dist in dists.items():
        curve = grid * dist.magnitudes().logpdf(grid).exp().numpy()
        ax.plot(grid, curve, **colors[name], label=name)
        peak = max(peak, min(float(np.nanmax(curve)), 4 * heights.max()))
    ax.set(
        xscale="log",
        xlim=(low, high),
        ylim=(0, 1.08 * peak),
        xlabel="|g|",
        ylabel="density of ln |g|",
        title="histogram of |g| (log bins), fitted densities",
    )


def _tail(ax, x: np.ndarray, grid, dists, colors, fits: pd.DataFrame) -> None:
    """The log-log CCDF of the upper half of the sorted sample ``x`` (the tail thresholds
    are read from, so its curves separate where they matter) with the fitted tails, and
    for each ratio of ``fits`` the empirical top-k threshold (dashed, labelled at the
    top) and each distribution's fitted threshold (open circles)."""
    n = x.size
    ax.plot(x, 1.0 - np.arange(n) / n, color="black", lw=2, label="empirical")
    for name, dist in dists.items():
        ax.plot(grid, dist.magnitudes().sf(grid).numpy(), **colors[name])
    for ratio, group in fits.groupby("ratio"):
        density = float(group["k"].iloc[0]) / float(group["nonzero"].iloc[0])
        empirical_threshold = float(group["empirical"].iloc[0])
        ax.axvline(empirical_threshold, color="0.4", ls="--", lw=0.8)
        ax.axhline(density, color="0.75", ls=":", lw=0.8)
        # the label on the dashed line at the top, clear of every marker
        ax.annotate(
            f"k/d = {ratio:g}",
            (empirical_threshold, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(2, -3),
            textcoords="offset points",
            rotation=90,
            ha="left",
            va="top",
            fontsize=7,
            color="0.3",
        )
        for row in group.itertuples(index=False):
            color = colors[row.dist]["color"]
            ax.plot(row.threshold, density, "o", mfc="none", mew=1.2, color=color, ms=5)
    ax.set(
        xscale="log",
        yscale="log",
        xlim=(float(np.quantile(x, 0.5)), 1.2 * float(x[-1])),
        ylim=(0.5 / n, 0.7),
        xlabel="|g|",
        ylabel="P(|g| > x)",
        title="tail (CCDF); dashed: top-k threshold,\ncircles: fitted thresholds",
    )
    plain_log_axis(ax, "x")  # a tail under two decades wide: 2, 5, 10, not 2x10^0


def _quantiles(cells: list, x: np.ndarray, dists, colors) -> None:
    """One Q-Q panel per distribution: fitted against empirical quantiles of ``x``,
    log-log, with the diagonal; quantiles off the scale are counted in a note, not piled
    on its edge."""
    probabilities = np.unique(
        np.concatenate([np.linspace(0.01, 0.9, 40), 1.0 - np.geomspace(0.1, 1.0 / x.size, 40)])
    )
    empirical = np.quantile(x, probabilities)
    lo, hi = empirical.min() / 2, empirical.max() * 2
    for ax, (name, dist) in zip(cells, dists.items(), strict=False):
        fitted = np.array([dist.magnitude_isf(1.0 - p) for p in probabilities])
        inside = (fitted >= lo) & (fitted <= hi)
        ax.plot(fitted[inside], empirical[inside], ".", color=colors[name]["color"])
        below, above = int((fitted < lo).sum()), int((fitted > hi).sum())
        off = [f"{below} below {lo:.1g}"] * bool(below) + [f"{above} above {hi:.1g}"] * bool(above)
        if off:
            ax.text(
                0.97,
                0.03,
                f"fitted quantiles off scale: {', '.join(off)}",
                transform=ax.transAxes,
                ha="right",
                va="bottom",
                fontsize=7,
                color="0.3",
            )
        ax.plot([lo, hi], [lo, hi], color="0.4", lw=0.8)
        ax.set(
            xscale="log",
            yscale="log",
            xlim=(lo, hi),
            ylim=(lo, hi),
            xlabel=f"{name} quantile",
            ylabel="empirical quantile",
            title=f"Q-Q {name}",
        )


def _legend(fig: Figure, hist, ccdf, free: list) -> None:
    """One legend for the figure (the histogram's entries, the empirical CCDF second):
    in the first ``free`` cell, else below the grid; the free cells blank."""
    handles, labels = hist.get_legend_handles_labels()
    handles.insert(1, ccdf.lines[0])
    labels.insert(1, "empirical CCDF")
    if free:
        free[0].legend(handles, labels, loc="center", fontsize="small", frameon=False)
    else:
        fig.legend(
            handles,
            labels,
            loc="outside lower center",
            ncols=min(len(labels), 5),
            fontsize="small",
            frameon=False,
        )
    for ax in free:
        ax.axis("off")


def plot_fit_at(
    records: pd.DataFrame, magnitudes: np.ndarray, step: int, learner: int, scope: str, name=""
) -> Figure:
    """:func:`plot_fit` of one (step, learner, scope) of a fit's records, titled by them
    (after ``name``, e.g. the capture's): what ``fit --plot`` and the report both draw."""
    chosen = records[
        (records["step"] == step) & (records["learner"] == learner) & (records["scope"] == scope)
    ]
    title = f"step {step}, learner {learner}, scope {scope}"
    return plot_fit(chosen, magnitudes, f"{name}: {title}" if name else title)
