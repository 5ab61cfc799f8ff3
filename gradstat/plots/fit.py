"""Figure of ``gradstat fit`` for one (step, learner, scope): how well each fitted
distribution describes |g| and where the thresholds at each ratio fall.

Panels: the histogram of |g| on log-spaced bins (as the density of ln|g|) with the
fitted densities; the log-log
complementary CDF with the fitted tails, the empirical top-k threshold at each ratio
(dashed) and each distribution's fitted threshold (markers); one Q-Q plot per
distribution (fitted against empirical quantiles, log-log, with the diagonal).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from gradstat.plots.style import new_figure
from gradstat.stats.distributions import Distribution, get_distribution


def _fitted(records: pd.DataFrame) -> dict[str, Distribution]:
    fits = records[(records["kind"] == "fit") & records["error"].isna()]
    first = fits.drop_duplicates("dist")
    return {
        row.dist: get_distribution(row.dist)(**row.params) for row in first.itertuples(index=False)
    }


def plot_fit(records: pd.DataFrame, magnitudes: np.ndarray, title: str) -> Figure:
    """Draw the fit figure from the records of one (step, learner, scope) and a sample of
    its non-zero magnitudes."""
    dists = _fitted(records)
    ncols = 3
    nrows = 1 + math.ceil(len(dists) / ncols)
    fig, axes = new_figure(nrows, ncols, width=4.2, height=3.4)
    x = np.sort(magnitudes)
    n = x.size
    grid = np.geomspace(x[0], x[-1], 400)
    colors = {name: f"C{i}" for i, name in enumerate(dists)}

    hist = axes[0, 0]
    # Density of ln|g| (x f(x)): on log-spaced bins the shape of the bulk stays readable.
    edges = np.geomspace(x[0], x[-1], 80)
    counts, _ = np.histogram(x, bins=edges)
    hist.stairs(counts / (n * np.diff(np.log(edges))), edges, fill=True, color="0.8", label="|g|")
    for name, dist in dists.items():
        curve = grid * dist.magnitudes().logpdf(grid).exp().numpy()
        hist.plot(grid, curve, color=colors[name], label=name)
    hist.set(
        xscale="log",
        ylim=(0, 1.3 * counts.max() / (n * np.diff(np.log(edges)).min())),
        xlabel="|g|",
        ylabel="density of ln|g|  (x f(x))",
        title="histogram",
    )
    hist.legend(fontsize="small")

    ccdf = axes[0, 1]
    survival = 1.0 - np.arange(n) / n
    ccdf.plot(x, survival, color="black", lw=2, label="empirical")
    for name, dist in dists.items():
        ccdf.plot(grid, dist.magnitudes().sf(grid).numpy(), color=colors[name], label=name)
    thresholds = records[(records["kind"] == "fit") & records["error"].isna()]
    for ratio, group in thresholds.groupby("ratio"):
        density = float(group["k"].iloc[0]) / float(group["nonzero"].iloc[0])
        ccdf.axvline(float(group["empirical"].iloc[0]), color="0.4", ls="--", lw=0.8)
        ccdf.annotate(f"{ratio:g}", (float(group["empirical"].iloc[0]), density), fontsize=7)
        for row in group.itertuples(index=False):
            ccdf.plot(row.threshold, density, "o", color=colors[row.dist], ms=4)
    ccdf.set(
        xscale="log",
        yscale="log",
        ylim=(0.5 / n, 1.5),
        xlabel="|g|",
        ylabel="P(|g| > x)",
        title="CCDF; dashed: top-k threshold per ratio",
    )
    ccdf.legend(fontsize="small")
    axes[0, 2].axis("off")

    probabilities = np.unique(
        np.concatenate([np.linspace(0.01, 0.9, 40), 1.0 - np.geomspace(0.1, 1.0 / n, 40)])
    )
    empirical = np.quantile(x, probabilities)
    for i, (name, dist) in enumerate(dists.items()):
        ax = axes[1 + i // ncols, i % ncols]
        fitted = np.array([dist.magnitude_isf(1.0 - p) for p in probabilities])
        ax.plot(fitted, empirical, ".", color=colors[name])
        lo, hi = min(fitted.min(), empirical.min()), max(fitted.max(), empirical.max())
        ax.plot([lo, hi], [lo, hi], color="0.4", lw=0.8)
        ax.set(xscale="log", yscale="log", xlabel=f"{name} quantile", ylabel="empirical")
        ax.set_title(f"Q-Q {name}")
    for j in range(len(dists), (nrows - 1) * ncols):
        axes[1 + j // ncols, j % ncols].axis("off")
    fig.suptitle(title)
    return fig
