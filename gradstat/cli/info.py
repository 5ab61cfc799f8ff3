"""``gradstat info``: what a capture holds and whether it finished."""

from __future__ import annotations

import pandas as pd
from rich.table import Table

from gradstat.cli.options import Capture, Csv, Json
from gradstat.cli.output import console, to_json, write_csv
from gradstat.store import open_capture


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{nbytes} B"
        nbytes /= 1024
    return str(nbytes)


def info_command(capture: Capture, as_json: Json = False, csv: Csv = None) -> None:
    """Show a capture's learners, committed steps, status, layers, size and loss.

    Works while the capture is still being written and after a crash: only rows that
    every learner committed are counted. --csv writes the layer table.
    """
    with open_capture(capture) as cap:
        summary = cap.describe()
    if csv is not None:  # the layer table, one row per parameter
        write_csv(pd.DataFrame(summary["layers"]), csv)
    if as_json:
        print(to_json(summary))
        return
    steps = summary["steps"]
    status = summary["status"]
    if status != "complete":
        last = f"step {steps[-1]}" if steps else "before the first step"
        status = f"{status} (committed up to {last})"
    overview = Table(title=f"capture {summary['path']}", title_justify="left", show_header=False)
    overview.add_column(style="bold")
    overview.add_column()
    rows = [
        ("workload", summary["workload"]),
        ("status", status),
        ("learners", f"{cap.learners_text()} ({summary['backend']})"),
        ("steps", f"{len(steps)} recorded" + (f": {steps[0]}..{steps[-1]}" if steps else "")),
        ("numel", f"{summary['numel']:,} per learner per step ({summary['dtype']})"),
        ("compression", summary["compression"]),
        ("layers", str(len(summary["layers"]))),
        ("size", _size(summary["bytes"])),
    ]
    loss = summary["loss"]
    if loss["first"] is not None:
        rows.append(("loss", f"{loss['first']:.4g} -> {loss['last']:.4g} (mean over learners)"))
    for key, value in rows:
        overview.add_row(key, value)
    console.print(overview)
    layers = Table(title="layers", title_justify="left", header_style="bold")
    for column, justify in (
        ("name", "left"),
        ("shape", "left"),
        ("numel", "right"),
        ("offset", "right"),
    ):
        layers.add_column(column, justify=justify)
    for layer in summary["layers"]:
        shape = "x".join(str(s) for s in layer["shape"]) or "scalar"
        layers.add_row(layer["name"], shape, f"{layer['numel']:,}", f"{layer['offset']:,}")
    console.print(layers)
