"""Figures of a capture itself: the learners' loss curves."""

from __future__ import annotations

import numpy as np
import seaborn as sns
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from gradstat.plots.style import legend_below, new_figure


def plot_loss(steps: np.ndarray, losses: np.ndarray, title: str = "training loss") -> Figure:
    """Each learner's loss (thin) and their mean (bold) over the recorded steps.

    ``losses`` is ``(learners, steps)`` as in ``Capture.losses``.
    """
    fig, axes = new_figure(1, 1, width=6.0, height=3.6)
    ax = axes[0, 0]
    # distinct hues (not the default cycle at half opacity, where two learners read as
    # one pale orange); many learners: a colormap, unlabelled
    colors = (
        sns.color_palette("colorblind", len(losses))
        if len(losses) <= 10
        else sns.color_palette("viridis", len(losses))
    )
    for learner, row in enumerate(losses):
        ax.plot(
            steps,
            row,
            color=colors[learner],
            linewidth=1.0,
            alpha=0.85,
            label=f"learner {learner}" if len(losses) <= 8 else None,
        )
    ax.plot(steps, np.nanmean(losses, axis=0), color="black", linewidth=2, label="mean")
    ax.set_xlabel("training step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps: no tick at 2.5
    ax.set_ylabel("loss (each learner's own batch)")
    ax.set_title(title)
    legend_below(fig, ax, ncols=5)
    return fig
