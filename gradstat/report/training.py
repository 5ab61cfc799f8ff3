"""The report's "Dense and compressed training" section: ``gradstat compare`` over the
capture and the runs beside it (same parent folder) of the same workload and seed, when
some of them were trained with a compression hook (``capture --compressor``)."""

from __future__ import annotations

import math
from pathlib import Path

from gradstat.analysis.compare import compare
from gradstat.errors import GradstatError
from gradstat.plots.compare import plot_compare
from gradstat.report.html import Section
from gradstat.store import Capture, open_capture
from gradstat.store.schema import ROOT_FILE

TITLE = "Dense and compressed training"


def sibling_runs(cap: Capture) -> list[Path]:
    """This capture and the captures beside it of the same workload, seed and model,
    dense first; empty unless one of them was trained with a compressor."""
    runs = [(cap.compressor is not None, cap.path)]
    for path in sorted(cap.path.parent.iterdir()):
        if path == cap.path or not (path / ROOT_FILE).is_file():
            continue
        try:
            with open_capture(path) as other:
                same = (
                    other.workload == cap.workload
                    and other.meta.get("seed") == cap.meta.get("seed")
                    and other.numel == cap.numel
                )
                if same and (other.compressor is None or other.has_sent):
                    runs.append((other.compressor is not None, path))
        except GradstatError:
            continue  # not a readable capture: not ours to judge here
    if not any(compressed for compressed, _ in runs) or len(runs) < 2:
        return []
    return [path for _, path in sorted(runs, key=lambda run: run[0])]


def training_section(cap: Capture) -> Section | None:
    """The section, or ``None`` when no compressed run of this training is at hand."""
    paths = sibling_runs(cap)
    if not paths:
        return None
    result = compare(paths)
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
