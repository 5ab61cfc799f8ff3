"""Every analysis command's --plot writes a real figure in the requested format."""

from __future__ import annotations

import itertools
import re

import pytest

from tests.helpers import assert_clean_error, run_cli

MAGIC = {".png": b"\x89PNG\r\n\x1a\n", ".pdf": b"%PDF-", ".svg": b"<?xml"}

# command arguments -> axes the figure must have (colour bars count as axes)
CASES = {
    "fit": (["fit", "--dist", "gpd,exp", "--ratios", "0.05", "--steps", "0"], 4),
    "similarity": (["similarity", "--ratio", "0.05"], 3),
    "buildup": (["buildup", "--ratios", "0.05,0.01"], 1),
    "overlap": (["overlap", "--ratio", "0.05"], 1),
    "replay": (["replay", "--compressors", "topk,clt-k", "--ratios", "0.05"], 3),
    "noise": (["noise", "--batch-size", "8", "--compressors", "topk", "--ratios", "0.05"], 2),
    "consistency": (["consistency"], 5),  # the heatmap's colour bar counts
}


def _drawn_axes(svg: str) -> int:
    """Axes drawn with at least one axis (axes switched off draw none)."""
    chunks = re.split(r'<g id="axes_\d+">', svg)[1:]
    return sum("matplotlib.axis" in chunk for chunk in chunks)


@pytest.mark.parametrize("command", sorted(CASES))
@pytest.mark.parametrize("suffix", [".png", ".pdf", ".svg"])
def test_plot_formats_and_axes(synthetic_capture, tmp_path, capsys, command, suffix):
    path, _ = synthetic_capture
    args, axes = CASES[command]
    out = tmp_path / f"figure{suffix}"
    result = run_cli(capsys, args[0], path, *args[1:], "--plot", out, "--dpi", "60")
    assert result.code == 0, result
    data = out.read_bytes()
    assert data.startswith(MAGIC[suffix]) and len(data) > 2000
    if suffix == ".svg":
        assert _drawn_axes(data.decode()) == axes


@pytest.mark.parametrize("command", sorted(CASES))
def test_bad_plot_suffix_fails_before_any_work(synthetic_capture, tmp_path, capsys, command):
    path, _ = synthetic_capture
    args, _ = CASES[command]
    result = run_cli(capsys, args[0], path, *args[1:], "--plot", tmp_path / "figure.jpg")
    assert_clean_error(result, code=2)
    assert "suffix" in result.stderr
    assert not (tmp_path / "figure.jpg").exists()


@pytest.mark.parametrize(("low", "high"), [(1e-12, 1.0), (2.0, 9.0)])
def test_saving_skips_only_invisible_minor_ticks(tmp_path, low, high):
    # save_figure drops the minor-tick locators of log axes spanning many decades (the
    # style draws no minor marks and matplotlib labels none there): the pixels must be
    # those of a plain savefig; a short log axis keeps its labelled minor ticks.
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import NullLocator
    from PIL import Image

    from gradstat.plots.style import new_figure, save_figure

    def figure():
        fig, axes = new_figure(1, 2)
        x = np.geomspace(low, high, 50)
        for ax in axes.flat:
            ax.loglog(x, x**0.5)
        return fig

    plain = figure()
    plain.savefig(tmp_path / "plain.png", dpi=60)
    ours = figure()
    save_figure(ours, tmp_path / "ours.png", dpi=60)
    minor = ours.axes[0].xaxis.get_minor_locator()
    plt.close(plain)
    assert isinstance(minor, NullLocator) == (high / low > 100)
    pixels = [np.asarray(Image.open(tmp_path / f"{n}.png")) for n in ("plain", "ours")]
    assert np.array_equal(*pixels)


def _overlapping_tick_labels(fig) -> list[str]:
    """Pairs of drawn x tick labels, on any axes of ``fig``, whose boxes overlap."""
    renderer = fig.canvas.get_renderer()
    found = []
    for ax in fig.axes:
        ticks = ax.xaxis.get_majorticklabels() + ax.xaxis.get_minorticklabels()
        boxes = [
            (t.get_text(), t.get_window_extent(renderer))
            for t in ticks
            if t.get_visible() and t.get_text()
        ]
        boxes.sort(key=lambda item: item[1].x0)
        for (a, box_a), (b, box_b) in itertools.pairwise(boxes):
            if box_a.x1 > box_b.x0:
                found.append(f"{ax.get_title()!r}: {a!r} / {b!r}")
    return found


def test_fit_figure_tail_labels_do_not_overlap(tmp_path):
    # regression: a tail spanning under two decades (|normal| magnitudes: median 0.67,
    # largest about 5) labelled its minor ticks 2x10^0, 3x10^0, 4x10^0 on top of each other
    import matplotlib.pyplot as plt
    import numpy as np

    from gradstat.analysis.fit import FitParams, fit, magnitude_sample
    from gradstat.analysis.selection import Selection
    from gradstat.plots.fit import plot_fit_at
    from gradstat.store import layer_table, open_capture, write_capture

    grads = np.random.default_rng(0).standard_normal((1, 1, 200_000)).astype(np.float32)
    write_capture(tmp_path / "cap", grads, layer_table([("w", (200_000,))]))
    with open_capture(tmp_path / "cap") as cap:
        selection = Selection.of(cap, steps=[0])
        records = fit(cap, selection, FitParams(dists="gpd,exp", ratios="0.01"))
        sample = magnitude_sample(cap, 0, 0, selection.scopes(cap)[0])
    fig = plot_fit_at(records, sample, 0, 0, "model")
    fig.canvas.draw()
    tail = next(ax for ax in fig.axes if ax.get_title().startswith("tail"))
    low, high = tail.get_xlim()
    assert high / low < 100  # the case: under two decades
    assert [t.get_text() for t in tail.xaxis.get_majorticklabels() if t.get_text()]
    overlaps = _overlapping_tick_labels(fig)
    plt.close(fig)
    assert not overlaps, overlaps


def _loss_frames(steps: int = 12):
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(0)
    losses = pd.DataFrame(
        [
            {"run": run, "label": label, "step": s, "learner": learner, "loss": 3 - s / 10}
            for run, label in (("dense", "dense"), ("lm-topk", "topk at 0.01"))
            for learner in range(2)
            for s in range(steps)
        ]
    )
    errors = pd.DataFrame(
        {
            "run": "lm-topk",
            "step": range(steps),
            "measured_rel_error": rng.uniform(0.6, 2.0, steps),
            "predicted_rel_error": rng.uniform(0.6, 2.0, steps),
        }
    )
    return losses, errors


def test_compare_figure_ticks_whole_steps_and_keeps_its_legend_off_the_data():
    """Regression: compare.png ticked steps at 2.5, labelled its log axis 6x10^-1 and
    drew legends inside the axes."""
    from gradstat.plots.compare import plot_compare

    fig = plot_compare(*_loss_frames())
    fig.canvas.draw()
    for ax in fig.axes:
        assert ax.get_legend() is None
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert all(float(t).is_integer() for t in ticks), ticks
    assert len(fig.legends) == 1
    labels = [t.get_text() for t in fig.axes[1].get_yticklabels() if t.get_text()]
    assert labels and not any("10^" in label or "times" in label for label in labels), labels


def test_fit_distributions_differ_in_colour_and_dash():
    """Regression: exp and normal, laplace and weibull were near-identical hues."""
    from gradstat.plots.fit import DIST_STYLES, dist_style

    styles = {name: dist_style(name, i) for i, name in enumerate(DIST_STYLES)}
    for a, b in (("exp", "normal"), ("laplace", "weibull")):
        assert styles[a]["color"] != styles[b]["color"]
        assert styles[a]["ls"] != styles[b]["ls"]
    assert len({s["color"] for s in styles.values()}) == len(styles)


def test_loss_plot_gives_each_learner_its_own_hue():
    """Regression: the report's loss plot drew two learners in near-identical pale
    oranges."""
    import numpy as np
    from matplotlib.colors import to_rgb

    from gradstat.plots.capture import plot_loss

    fig = plot_loss(np.arange(10), np.ones((2, 10)) + np.arange(2)[:, None])
    lines = fig.axes[0].get_lines()
    first, second = (np.array(to_rgb(line.get_color())) for line in lines[:2])
    assert np.abs(first - second).sum() > 0.5
    assert all(line.get_alpha() is None or line.get_alpha() >= 0.8 for line in lines)


def test_replay_figure_marks_compressors_apart_and_smooths_long_runs():
    """Regression: 9 series x 100 markers made the error over steps unreadable, and
    bf16's marker hid fp16's."""
    import math

    import pandas as pd

    from gradstat.plots.replay import plot_replay

    rows = [
        {
            "scope": "model",
            "compressor": name,
            "ratio": ratio,
            "step": s,
            "bytes_per_learner": nbytes,
            "rel_error": error * (1 + (s % 3) / 10),
            "buildup": math.nan if math.isnan(ratio) else 1.5,
        }
        for name, ratio, nbytes, error in (
            ("topk", 0.01, 1000.0, 0.5),
            ("dgc", 0.01, 1100.0, 0.6),
            ("fp16", math.nan, 8000.0, 1e-8),
            ("bf16", math.nan, 8000.0, 1e-6),
        )
        for s in range(100)
    ]
    fig = plot_replay(pd.DataFrame(rows))
    trade, error = fig.axes[0], fig.axes[1]
    markers = {line.get_marker() for line in error.get_lines() if line.get_marker() != "None"}
    assert len(markers) == 2  # topk and dgc: one marker each
    assert "running median" in error.get_title()
    edge = [line.get_xdata()[0] for line in trade.get_lines() if line.get_marker() == "v"]
    assert len(edge) == 2 and edge[0] != edge[1]  # fp16 and bf16 side by side
