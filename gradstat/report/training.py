"""The report's "Dense and compressed training" section: ``gradstat compare`` over the
capture and the runs the user names with ``report --with RUN`` (dense and trained with a
compression hook, ``capture --compressor``). No other capture is read: a folder's
neighbours are not the user's to vouch for, and a capture is never asked which code to
run (gradstat/analysis/trained_with.py)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from gradstat.analysis.compare import compare
from gradstat.plots.compare import plot_compare
from gradstat.report.html import Section
from gradstat.store import Capture

TITLE = "Dense and compressed training"


def training_section(
    cap: Capture, runs: Sequence[str | Path], trained_with: Mapping[str, str] | None = None
) -> Section | None:
    """The section comparing ``cap`` with ``runs``, in that order (``None`` without
    any runs); the first dense run is the open-loop reference. ``trained_with``: as
    :func:`~gradstat.analysis.compare.compare` takes it."""
    if not runs:
        return None
    paths = [cap.path, *(Path(run) for run in runs)]
    result = compare(paths, trained_with=trained_with)
    summary = result.summary
    compressed = summary[summary["label"] != "dense"]
    parts = []
    for row in compressed.itertuples():
        diverges = (
            "never leaves the tolerance"
            if math.isnan(row.divergence_step)
            else f"leaves it at step {int(row.divergence_step)}"
        )
        parts.append(
            f"{row.run} ({row.label}): online error {row.measured_rel_error:.3g} against "
            f"{row.predicted_rel_error:.3g} predicted by the open-loop replay, which "
            f"{diverges}; final loss {row.loss_last:.4g}."
        )
    dense = summary[summary["label"] == "dense"]
    if len(dense):
        parts.insert(
            0, f"Dense run {dense['run'].iloc[0]}: final loss {dense['loss_last'].iloc[0]:.4g}."
        )
    reading = " ".join(parts) + (
        " The replay follows the dense trajectory; the compressed run drifts away from it, "
        "so the prediction holds at first and parts later (docs/online.md)."
    )
    return Section(
        "training",
        TITLE,
        reading,
        [plot_compare(result.losses, result.errors)],
        [("runs, means over steps", summary)],
    )
