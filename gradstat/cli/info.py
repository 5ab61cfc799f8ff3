"""``gradstat info``: what a capture holds and whether it finished."""

from __future__ import annotations

import itertools
import math
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from gradstat.cli.options import Capture, Csv, Json
from gradstat.cli.output import console, to_json, write_csv
from gradstat.errors import DataError
from gradstat.sizes import format_bytes
from gradstat.untrusted import printable

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
        checked = _verify(cap) if verify else None
        summary = cap.describe()
        if checked is not None:
            summary["checked"] = checked
        summary["missing_steps"] = missing_steps(summary["steps"], cap.meta.get("every"))
        learners = cap.learners_text()
        damage = cap.damage_report() if cap.damage else None
    if csv is not None:  # the layer table, one row per parameter
        import pandas as pd

        write_csv(pd.DataFrame(summary["layers"]), csv)
    if as_json:
        print(to_json(summary))
    else:
        _print_tables(summary, learners)
        if checked is not None:
            console.print(escape(_checked_text(checked)), highlight=False)
    if damage is not None:
        raise DataError(damage)


def _verify(cap) -> dict:
    """Read every committed row of the learners not already found damaged and check it
    against its checksums (``--verify``): what was read, and the rows that failed."""
    import numpy as np

    from gradstat.store.dtypes import DISK_DTYPES

    known = {d.learner for d in cap.damage}
    learners = [
        (learner, rows)
        for learner, rows in zip(cap.recorded_ranks, cap.committed_per_learner, strict=True)
        if learner not in known
    ]
    found = cap.verify_rows()
    rows = sum(n for _, n in learners)
    datasets = 2 if cap.has_sent else 1
    return {
        "learners": len(learners),
        "rows": rows * datasets,
        "bytes": rows * datasets * cap.numel * np.dtype(DISK_DTYPES[cap.dtype]).itemsize,
        "failed_rows": sum(len(d.rows) for d in found),
        "check": cap.verification,
    }


def _checked_text(checked: dict) -> str:
    """``--verify: read 40 rows of 2 learners (6.1 MB): all match their CRC-32C.``"""
    read = (
        f"--verify: read {_count(checked['rows'], 'row')} of "
        f"{_count(checked['learners'], 'learner')} ({format_bytes(checked['bytes'])})"
    )
    if checked["failed_rows"]:
        return f"{read}: {_count(checked['failed_rows'], 'row')} failed (see status)."
    if checked["check"].startswith("CRC-32C"):
        return f"{read}: every row matches its CRC-32C."
    return f"{read}: every row lies inside its file (schema 1 has no row checksums)."


def _count(n: int, noun: str) -> str:
    """``formatting.counted``'s rule; info imports neither pandas nor numpy to start."""
    return f"{n} {noun}" + ("s" if n != 1 else "")


def _steps_text(summary: dict) -> str:
    """``3 recorded: 0..20 every 10``; uneven steps as spans (``0..4, 9, 12..15``), or,
    where the spans are too many to list, the span and how many steps are missing."""
    from gradstat.store.verify import span_text

    steps = summary["steps"]
    if not steps:
        return "0 recorded"
    gaps = {b - a for a, b in itertools.pairwise(steps)}
    if len(gaps) > 1:
        spans = span_text(steps)
        if len(spans) > 40:
            missing = summary["missing_steps"]["count"]
            spans = f"{steps[0]}..{steps[-1]}, {missing} missing"
        return f"{len(steps)} recorded: {spans}"
    every = f" every {gaps.pop()}" if gaps and gaps != {1} else ""
    span = f"{steps[0]}..{steps[-1]}" if len(steps) > 1 else str(steps[0])
    return f"{len(steps)} recorded: {span}{every}"


def _status_text(summary: dict) -> str:
    from gradstat.store.verify import span_text

    steps = summary["steps"]
    status = summary["status"]
    if status == "damaged":
        parts = [
            f"learner {d['learner']} "
            + (
                f"{'step' if len(d['steps']) == 1 else 'steps'} {span_text(d['steps'])}"
                if d["steps"]
                else "whole file"
            )
            for d in summary["damage"]
        ]
        return f"damaged: {'; '.join(parts)}"
    if status != "complete":
        last = f"step {steps[-1]}" if steps else "before the first step"
        reason = f"{summary['stop_reason']}, " if summary.get("stop_reason") else ""
        status = f"{status} ({reason}committed up to {last})"
    return status


#: Missing steps that ``info`` lists before it only counts them.
SHOWN_MISSING = 10


def missing_steps(steps: list[int], every: int | None) -> dict:
    """Steps absent between the first and the last recorded one (rows the capture did not
    record, e.g. a step dropped with a warning): ``{"count": N, "first": [...]}``.

    Recorded steps sit on a stride: the greatest common divisor of the capture's
    ``every`` and the gaps between recorded steps (so step labels that start anywhere
    work); the first :data:`SHOWN_MISSING` missing steps are listed.
    """
    if len(steps) < 2:
        return {"count": 0, "first": []}
    stride = math.gcd(int(every or 0), *(b - a for a, b in itertools.pairwise(steps)))
    if stride == 0:
        return {"count": 0, "first": []}
    count = (steps[-1] - steps[0]) // stride + 1 - len(steps)
    present, first = set(steps), []
    step = steps[0]
    while len(first) < min(count, SHOWN_MISSING):
        if step not in present:
            first.append(step)
        step += stride
    return {"count": count, "first": first}


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
    status = _status_text(summary)
    overview = Table(
        title=f"capture {escape(printable(summary['path']))}",
        title_justify="left",
        show_header=False,
    )
    overview.add_column(style="bold")
    overview.add_column()
    rows = [
        ("workload", summary["workload"]),
        ("status", status),
        ("learners", f"{learners} ({summary['backend']})"),
        ("steps", _steps_text(summary)),
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
        overview.add_row(key, escape(printable(value)))
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
        name = escape(printable(layer["name"]))
        layers.add_row(name, shape, f"{layer['numel']:,}", f"{layer['offset']:,}")
    console.print(layers)
