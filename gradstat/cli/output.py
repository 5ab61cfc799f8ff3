"""Rendering results: rich tables for people, ``--json`` and ``--csv`` for programs.

Conventions (after the Hugging Face ``hf`` CLI): ``--json`` prints exactly one JSON
document on stdout and nothing else there; tables, progress and warnings never mix into
it (progress and warnings go to stderr).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np
import pandas as pd
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from gradstat.errors import UsageError
from gradstat.formatting import format_cell

console = Console()
err_console = Console(stderr=True)
T = TypeVar("T")


def _plain(value):
    """Make a value JSON-ready: numpy scalars to Python, NaN/Inf to null."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is pd.NA or value is pd.NaT:
        return None
    return value


def to_json(document) -> str:
    """One JSON document; DataFrames become lists of records."""
    if isinstance(document, pd.DataFrame):
        document = document.to_dict(orient="records")
    return json.dumps(_plain(document), indent=2)


def write_csv(df: pd.DataFrame, path: Path) -> None:
    """Write a result table; dict/list cells are stored as JSON text."""
    out = df.copy()
    for column in out.columns:
        if out[column].map(lambda v: isinstance(v, (dict, list, tuple))).any():
            out[column] = out[column].map(lambda v: json.dumps(_plain(v)))
    try:
        out.to_csv(path, index=False)
    except OSError as exc:
        raise UsageError(f"--csv {path}: cannot write ({exc.strerror})") from exc
    err_console.print(f"[dim]wrote {path}[/dim]")


def df_table(df: pd.DataFrame, title: str, columns: Sequence[str] | None = None) -> Table:
    """A rich table of ``df`` (chosen columns), numbers formatted to 4 significant digits."""
    columns = list(columns or df.columns)
    table = Table(title=title, title_justify="left", header_style="bold")
    for column in columns:
        numeric = pd.api.types.is_numeric_dtype(df[column])
        table.add_column(column, justify="right" if numeric else "left")
    for row in df[columns].itertuples(index=False):
        table.add_row(*(format_cell(v) for v in row))
    return table


def emit(
    records: pd.DataFrame,
    *,
    as_json: bool,
    csv: Path | None,
    tables: Iterable[Table] = (),
    json_document=None,
) -> None:
    """Print tables (or the JSON document) and write the CSV of ``records``."""
    if csv is not None:
        write_csv(records, csv)
    if as_json:
        print(to_json(records if json_document is None else json_document))
        return
    for table in tables:
        console.print(table)


def progress(
    items: Sequence[T] | Iterable[T], description: str, total: int | None = None
) -> Iterator[T]:
    """Iterate with a progress bar on stderr (hidden when stderr is not a terminal)."""
    total = total if total is not None else (len(items) if hasattr(items, "__len__") else None)
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(
        *columns, console=err_console, transient=True, disable=not err_console.is_terminal
    ) as bar:
        task = bar.add_task(description, total=total)
        for item in items:
            yield item
            bar.advance(task)


def note_sample(cap) -> None:
    """Say on stderr when a capture recorded only some of the run's learners
    (``--record-ranks``): analyses use those, the cost model the run's world size."""
    if cap.is_sample:
        err_console.print(
            f"note: the run had {cap.world_size} learners; {cap.path} recorded "
            f"{cap.learners_text()}, and the analysis uses those",
            highlight=False,
        )


def warn(message: str) -> None:
    """One warning line on stderr."""
    err_console.print(f"[yellow]Warning:[/yellow] {message}", highlight=False)
