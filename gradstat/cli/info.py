"""``gradstat info``: what a capture holds and whether it finished."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from gradstat.cli.options import Capture, Csv, Json
from gradstat.cli.output import console, to_json, write_csv
from gradstat.errors import DataError
from gradstat.sizes import format_bytes

Verify = Annotated[
    bool,
    typer.Option("--verify", help="Also read every row and check it against its CRC-32C (slow)."),
]


def info_command(
    capture: Capture, as_json: Json = False, csv: Csv = None, verify: Verify = False
) -> None:
    """Show a capture's learners, committed steps, status, layers, size and loss.

    Works while the capture is still being written and after a crash: only rows that
    every learner committed are counted. A damaged capture (rows missing from a rank
    file) is shown with status "damaged" and the steps at fault, then exits 1; --verify
    also reads every row and checks its checksum. --csv writes the layer table.

    Example: gradstat info captures/demo/capture --verify
    """
    from gradstat.store.reader import open_capture  # h5py: only once a capture is read

    with open_capture(capture, allow_damaged=True) as cap:
        if verify:
            cap.verify_rows()
        summary = cap.describe()
        learners = cap.learners_text()
        damage = cap.damage_report() if cap.damage else None
    if csv is not None:  # the layer table, one row per parameter
        import pandas as pd

        write_csv(pd.DataFrame(summary["layers"]), csv)
    if as_json:
        print(to_json(summary))
    else:
        _print_tables(summary, learners)
    if damage is not None:
        raise DataError(damage)


def _status_text(summary: dict) -> str:
    from gradstat.store.verify import span_text

    steps = summary["steps"]
    status = summary["status"]
    if status == "damaged":
        parts = [
            f"learner {d['learner']} "
            + (f"steps {span_text(d['steps'])}" if d["steps"] else "whole file")
            for d in summary["damage"]
        ]
        return f"damaged: {'; '.join(parts)}"
    if status != "complete":
        last = f"step {steps[-1]}" if steps else "before the first step"
        reason = f"{summary['stop_reason']}, " if summary.get("stop_reason") else ""
        status = f"{status} ({reason}committed up to {last})"
    return status


def compressor_text(summary: dict) -> str:
    """The gradient compressor training ran (``capture --compressor``): its name, ratio
    and settings, and that /sent holds what each learner sent."""
    compressor = summary.get("compressor")
    if compressor is None:
        if summary.get("data_parallel") == "fsdp2":
            return "no gradient compressor (FSDP2 reduce-scatter)"
        return "no gradient compressor (plain all-reduce)"
    text = compressor["name"]
    if compressor["ratio"] is not None:
        text += f" at ratio {compressor['ratio']:g}"
    settings = ", ".join(f"{k}={v}" for k, v in compressor["settings"].items())
    if settings:
        text += f" ({settings})"
    if "sent" in summary.get("datasets", []):
        text += "; /sent holds what each learner sent"
    return text


def filter_text(compression: str) -> str:
    """HDF5's storage compression of the rows (lossless; not gradient compression)."""
    if compression in (None, "none"):
        return "none (rows stored uncompressed)"
    return f"{compression} (lossless storage compression of the rows)"


def _print_tables(summary: dict, learners: str) -> None:
    steps = summary["steps"]
    status = _status_text(summary)
    overview = Table(
        title=f"capture {escape(summary['path'])}", title_justify="left", show_header=False
    )
    overview.add_column(style="bold")
    overview.add_column()
    rows = [
        ("workload", summary["workload"]),
        ("status", status),
        ("learners", f"{learners} ({summary['backend']})"),
        ("steps", f"{len(steps)} recorded" + (f": {steps[0]}..{steps[-1]}" if steps else "")),
        ("numel", f"{summary['numel']:,} per learner per step ({summary['dtype']})"),
        ("trained with", compressor_text(summary)),
        ("HDF5 filter", filter_text(summary["compression"])),
        ("layers", str(len(summary["layers"]))),
        ("size", format_bytes(summary["bytes"])),
        ("verified", summary["verification"]),
    ]
    loss = summary["loss"]
    if loss["first"] is not None:
        rows.append(("loss", f"{loss['first']:.4g} -> {loss['last']:.4g} (mean over learners)"))
    for key, value in rows:
        overview.add_row(key, escape(value))
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
        layers.add_row(escape(layer["name"]), shape, f"{layer['numel']:,}", f"{layer['offset']:,}")
    console.print(layers)
