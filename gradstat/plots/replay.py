"""Figures of a compressor replay, from the per-step records of
:func:`gradstat.analysis.replay.replay`.

Three panels on a 2 x 2 grid (the fourth cell holds the legend), 4:3 so it fits a paper
column: mean relative error against mean bytes per learner (one point per compressor
and rate, log-log: the trade-off a compressor designer picks from), the relative error
over steps (does error feedback keep it bounded?), and build-up ``U/k`` over steps for
the sparse exchanges (ScaleCom, arXiv 2104.11125). Colours are keyed by compressor as
in every figure (:func:`~gradstat.plots.style.compressor_color`), markers by compressor
(drawn on every few steps, so 9 series of 100 steps stay readable) and line styles by
ratio, so two rates of one compressor stay apart where their lines coincide.
Casts (fp16, bf16) whose error is orders of magnitude below the others' are drawn at the
bottom edge of the trade-off panel with their value, and left out of the error over
steps, so they do not squeeze every sparsifier into one blob.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from gradstat.plots.style import compressor_color, new_figure, plain_log_axis

#: One marker per compressor ("v" marks a configuration drawn apart, at the edge).
MARKERS = "osD^P*XphH<>"
LINESTYLES = ("-", "--", ":", "-.")
#: A configuration whose mean error is below this fraction of the median configuration's
#: is drawn apart (at the trade-off panel's bottom edge), e.g. fp16 at 1e-8.
APART = 1e-3
#: Points closer than this on both log axes (in decades) are said to coincide.
COINCIDE = 0.02
#: From this many steps on, the panels over steps draw running medians.
SMOOTH_FROM = 20


def _label(compressor: str, ratio: float) -> str:
    return compressor if math.isnan(ratio) else f"{compressor} {ratio:g}"


def plot_replay(records: pd.DataFrame) -> Figure:
    """Error vs bytes, error over steps and build-up over steps (first scope only).

    Each compressor keeps one colour in every panel and each ratio one marker and line
    style, named in one legend beside the panels, so no label sits on a point or a line;
    points that coincide say so in the legend (``= topk 0.01``).
    """
    scope = records["scope"].iloc[0]
    data = records[records["scope"] == scope].copy()
    data["label"] = [_label(c, r) for c, r in zip(data["compressor"], data["ratio"], strict=True)]
    style = _styles(
        sorted(data["ratio"].dropna().unique(), reverse=True),
        list(dict.fromkeys(data["compressor"])),
    )
    # markers on every few steps tell series apart without hiding the lines; past
    # SMOOTH_FROM steps a running median carries each series, the raw steps faint below
    steps = data["step"].nunique()
    every = {"markevery": max(1, steps // 8), "ms": 4.5, "lw": 1.2, "mfc": "none", "mew": 1.1}
    window = _window(steps)
    means = data.groupby("label", sort=False)[["bytes_per_learner", "rel_error"]].mean()
    typical = float(means["rel_error"].median())
    apart = set(means.index[means["rel_error"] < APART * typical]) if typical > 0 else set()
    kept = means.drop(index=list(apart))
    fig, axes = new_figure(2, 2, width=4.6, height=3.5)
    (trade, error), (buildup, key) = axes
    floor = float(kept["rel_error"][kept["rel_error"] > 0].min()) / 2 if len(kept) else 1e-3
    placed: list[tuple[str, float, float]] = []
    handles: list[Line2D] = []
    curves: list[tuple[str, np.ndarray]] = []
    stacked: dict[float, int] = {}  # labels drawn at the bottom edge, per x
    for label, group in data.groupby("label", sort=False):
        look = style(group)
        x, y = means.loc[label, "bytes_per_learner"], means.loc[label, "rel_error"]
        same = _coinciding(placed, x, y)
        curve = group["buildup"].to_numpy(dtype=float)
        shown = label + _notes(same, _twin(curves, curve), curve)
        curves.append((label, curve))
        marker = "v" if label in apart else look["marker"]
        handles.append(Line2D([], [], **{**look, "marker": marker}, mfc="none", label=shown))
        if label in apart:
            _draw_apart(trade, label, (x, y), floor, look, stacked)
        else:
            # open markers, a size larger for each point they cover: both stay visible
            size = 7 + 4 * len(same)
            trade.plot(x, y, ms=size, mfc="none", mew=1.6, **{**look, "ls": "none"})
            _series(error, group["step"], group["rel_error"], window, every, look)
        placed.append((label, x, y))
        if np.isfinite(group["buildup"]).any():
            _series(buildup, group["step"], group["buildup"], window, every, look)
    _label_axes(trade, error, buildup, scope, kept, apart, floor, window)
    key.axis("off")
    key.legend(
        handles=handles, loc="center", fontsize="small", frameon=False, title="compressor, ratio"
    )
    return fig


def _window(steps: int) -> int:
    """Steps in the running median of a panel over ``steps`` steps (1: none), odd."""
    return 1 if steps < SMOOTH_FROM else max(3, steps // 10) | 1


def _series(ax, steps: pd.Series, values: pd.Series, window: int, every: dict, look: dict):
    """One configuration over steps: as it is, or its running median over ``window``
    steps with the raw values faint beneath."""
    if window == 1:
        ax.plot(steps, values, **every, **look)
        return
    ax.plot(steps, values, color=look["color"], lw=0.5, alpha=0.3)
    smooth = values.rolling(window, center=True, min_periods=1).median()
    ax.plot(steps, smooth, **every, **look)


def _styles(ratios: list[float], compressors: list[str]):
    """The style of a configuration's records: its compressor's colour and marker, and a
    line style per ratio in ``ratios`` (fixed-rate compressors: solid)."""
    markers = {c: MARKERS[i % len(MARKERS)] for i, c in enumerate(compressors)}
    lines = {r: LINESTYLES[i % len(LINESTYLES)] for i, r in enumerate(ratios)}

    def style(group: pd.DataFrame) -> dict:
        ratio, compressor = group["ratio"].iloc[0], group["compressor"].iloc[0]
        return {
            "color": compressor_color(compressor),
            "marker": markers[compressor],
            "ls": "-" if math.isnan(ratio) else lines[ratio],
        }

    return style


def _coinciding(placed: list[tuple[str, float, float]], x: float, y: float) -> list[str]:
    """The labels of the ``placed`` points within ``COINCIDE`` decades of (x, y)."""
    return [
        other
        for other, ox, oy in placed
        if y > 0
        and oy > 0
        and abs(math.log10(x / ox)) < COINCIDE
        and abs(math.log10(y / oy)) < COINCIDE
    ]


def _twin(curves: list[tuple[str, np.ndarray]], curve: np.ndarray) -> str | None:
    """The label of an earlier build-up curve equal to ``curve``, if any."""
    return next(
        (o for o, c in curves if c.shape == curve.shape and np.allclose(c, curve, equal_nan=True)),
        None,
    )


def _notes(same: list[str], twin: str | None, curve: np.ndarray) -> str:
    """The legend's note on what a configuration's point or build-up coincides with."""
    notes = [f"= {same[0]} in error vs traffic"] if same else []
    if twin is not None and np.isfinite(curve).any():
        notes.append(f"build-up = {twin}'s")
    return f" ({'; '.join(notes)})" if notes else ""


def _draw_apart(ax, label: str, at: tuple[float, float], floor: float, look, stacked) -> None:
    """A configuration drawn apart: a triangle at the bottom edge ``floor`` at its bytes,
    labelled with its error; labels at one x stack upwards (``stacked`` counts them)."""
    x, y = at
    above = stacked.get(x, 0)
    stacked[x] = above + 1
    # side by side where several share the bytes (fp16 and bf16): none hides another
    ax.plot(x * 1.12**above, floor, ls="none", ms=8, marker="v", color=look["color"])
    ax.annotate(
        f"{label}: {y:.1g}",
        (x, floor),
        xytext=(-6, 7 + 9 * above),
        textcoords="offset points",
        ha="right",
        fontsize=7,
        color=look["color"],
    )


def _label_axes(
    trade, error, buildup, scope: str, kept, apart: set, floor: float, window: int
) -> None:
    """Scales, limits, labels and titles of the three panels: log axes where the errors
    are positive, room for the bottom edge where configurations are drawn apart."""
    trade.set_xscale("log")
    if (kept["rel_error"] > 0).any():
        trade.set_yscale("log")
        error.set_yscale("log")
        if apart:
            top = float(kept["rel_error"].max()) * 1.5
            trade.set_ylim(floor / 1.6, top)
    trade.set(
        xlabel="bytes sent per learner per step",
        ylabel="mean relative error ||ĝ - g||² / ||g||²",
        title=f"error vs traffic ({scope})",
    )
    left_out = (
        f"\n{', '.join(sorted(apart))} left out (error < {APART:g} x typical)" if apart else ""
    )
    smooth = f", running median of {window} steps" if window > 1 else ""
    error.set(
        xlabel="training step",
        ylabel="relative error",
        title="error over steps" + smooth + left_out,
    )
    if apart or window > 1:
        error.title.set_fontsize("small")
    buildup.set(
        xlabel="training step",
        ylabel="build-up U / k",
        title="build-up of the sparse exchanges" + smooth,
    )
    for ax in (trade, error):
        plain_log_axis(ax, "y")
    plain_log_axis(trade, "x")
