"""One result, rendered for people or programs (after the Hugging Face ``hf`` CLI).

A command builds one :class:`Result` and hands it to :func:`show`, which prints the
summary tables and the answer (the default, fitting the terminal's width without
cutting a number), adds the per-row tables with ``--detail``, prints exactly one JSON
document with ``--json`` (nothing else on stdout), writes the per-row records with
``--csv`` and draws the figure with ``--plot``. Progress and warnings go to stderr.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from gradstat.untrusted import printable

if TYPE_CHECKING:  # numpy and pandas load with the first table: --help needs neither
    import pandas as pd


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """``gradstat info CAP | head -3``: the reader took what it wanted. Exit 0, not
        rich's 1 (which gradstat's exit codes read as bad data); no more output."""
        self.quiet = True
        os.dup2(os.open(os.devnull, os.O_WRONLY), self.file.fileno())
        raise SystemExit(0)


# no emoji codes: a name such as ``mine.py:Top:bits=2`` must print as written, not as 🔝
console = _Console(emoji=False)
err_console = _Console(stderr=True, emoji=False)
T = TypeVar("T")

#: Plain progress (stderr not a terminal: a log, CI) prints a line each time another
#: tenth of the work is done, at most one per ``PLAIN_PROGRESS_EVERY`` seconds ...
PLAIN_PROGRESS_EVERY = 5.0
PLAIN_PROGRESS_STEP = 0.1
#: ... and repeats its line after this many seconds without one (one long unit).
HEARTBEAT_EVERY = 60.0


@dataclass
class View:
    """A table as people read it: a title, an optional note explaining the columns, the
    rows, and which columns to show under which headers (all, as named, by default)."""

    title: str
    rows: pd.DataFrame
    columns: dict[str, str] | None = None
    note: str = ""
    #: Leading columns that name a row (step, learner, ...): a table too wide for the
    #: terminal is printed in parts that each repeat them.
    keys: int = 1

    def shown(self) -> pd.DataFrame:
        """The rows with the chosen columns under their headers."""
        if self.columns is None:
            return self.rows
        return self.rows[list(self.columns)].rename(columns=self.columns)

    def records(self) -> list[dict]:
        return self.rows.to_dict(orient="records")


@dataclass
class Result:
    """Everything one analysis command shows.

    ``records`` are the per-row results (``--csv``; the JSON document's ``records``);
    ``summary`` the tables printed by default and ``answer`` the conclusion in sentences,
    printed under them; ``detail`` the per-row tables that ``--detail`` adds;
    ``document`` the JSON document (default: records plus each summary table by key);
    ``figure`` draws the ``--plot`` figure.
    """

    records: pd.DataFrame
    summary: list[View] = field(default_factory=list)
    answer: list[str] = field(default_factory=list)
    detail: list[View] = field(default_factory=list)
    document: dict | None = None
    figure: Callable[[], object] | None = None

    def json_document(self) -> dict:
        if self.document is not None:
            return self.document
        return {
            "records": self.records.to_dict(orient="records"),
            "summary": self.summary[0].records() if self.summary else [],
        }


@dataclass
class Output:
    """How the user asked to see a result (the shared output options)."""

    as_json: bool = False
    csv: Path | None = None
    detail: bool = False
    plot: Path | None = None
    dpi: int = 150


def show(result: Result, output: Output) -> None:
    """Render ``result`` as ``output`` asks: CSV and figure files, then JSON or tables."""
    if output.csv is not None:
        write_csv(result.records, output.csv)
    if output.plot is not None and result.figure is not None:
        from gradstat.plots.style import save_figure

        save_figure(result.figure(), output.plot, dpi=output.dpi)
        err_console.print(f"[dim]wrote {escape(str(output.plot))}[/dim]")
    if output.as_json:
        print(to_json(result.json_document()))
        return
    views = (result.detail if output.detail else []) + result.summary
    for view in views:
        print_view(view)
    if result.answer:
        answer = "\n".join(printable(line) for line in result.answer)
        console.print(Panel(escape(answer), title="answer", title_align="left"))
    if result.detail and not output.detail:
        console.print("[dim]per-row detail: --detail, --json or --csv PATH[/dim]")


def _plain(value):
    """Make a value JSON-ready: numpy scalars to Python, NaN/Inf to null.

    numpy and pandas values exist only once their module is loaded, so the checks look
    them up in ``sys.modules`` instead of importing them for a document of plain values.
    """
    np, pd = sys.modules.get("numpy"), sys.modules.get("pandas")
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or (np is not None and isinstance(value, np.ndarray)):
        return [_plain(v) for v in value]
    if np is not None and isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if pd is not None and (value is pd.NA or value is pd.NaT):
        return None
    return value


def to_json(document) -> str:
    """One JSON document; DataFrames become lists of records."""
    pd = sys.modules.get("pandas")
    if pd is not None and isinstance(document, pd.DataFrame):
        document = document.to_dict(orient="records")
    return json.dumps(_plain(document), indent=2)


def write_csv(df: pd.DataFrame, path: Path) -> None:
    """Write a result table, whole or not at all (gradstat/atomic.py); dict/list cells
    are stored as JSON text, text cells a spreadsheet would run as formulas made inert
    (gradstat/untrusted.py)."""
    import pandas as pd

    from gradstat.atomic import replacing
    from gradstat.untrusted import safe_cell

    out = df.copy()
    for column in out.columns:
        if out[column].map(lambda v: isinstance(v, (dict, list, tuple))).any():
            out[column] = out[column].map(lambda v: json.dumps(_plain(v)))
        if not pd.api.types.is_numeric_dtype(out[column]):
            out[column] = out[column].map(safe_cell)
    with replacing(path, "--csv") as handle:
        out.to_csv(handle, index=False)
    err_console.print(f"[dim]wrote {escape(str(path))}[/dim]")


def df_table(
    df: pd.DataFrame, title: str | None = None, widths: Sequence[int] | None = None
) -> Table:
    """A compact rich table of ``df``; numbers to 4 significant digits, right-aligned.

    ``widths`` (from :func:`layout`) fixes each column's width, at least its longest
    number and its longest word, so a cell or header wraps at its spaces and a number is
    never cut; without them rich sizes the columns.
    """
    import pandas as pd

    from gradstat.formatting import format_cell

    table = Table(
        title=escape(title) if title else title,
        title_justify="left",
        header_style="bold",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    for i, column in enumerate(df.columns):
        # a long name (a user's compressor, path/to/file.py:CLASS) wraps, never ends in …
        table.add_column(
            escape(printable(column)),
            justify="right" if _numeric(df[column], pd) else "left",
            overflow="fold",
            width=None if widths is None else widths[i],
        )
    for row in df.itertuples(index=False):
        table.add_row(*(escape(printable(format_cell(v))) for v in row))
    return table


def _numeric(series, pd) -> bool:
    return pd.api.types.is_numeric_dtype(series) and not pd.api.types.is_bool_dtype(series)


#: Characters a SIMPLE_HEAD table without edge padding adds: its two edges and, between
#: two columns, the padding on either side of the divider.
EDGES, BETWEEN = 2, 3


def _longest_word(text: str) -> int:
    return max((len(word) for word in text.split()), default=0)


def layout(df: pd.DataFrame, width: int, keys: int = 1) -> list[tuple[list, list[int]]]:
    """How to print ``df`` within ``width`` characters: one or more parts, each a list
    of columns and their widths. Every column gets at least its longest number (numbers
    never wrap) and its longest word (text and headers wrap at spaces only). Headers wrap
    first, then text cells; a table that is still too wide is cut into parts of whole
    columns, each repeating the first ``keys`` columns."""
    import pandas as pd

    from gradstat.formatting import format_cell

    full, header_wrapped, narrowest = {}, {}, {}
    for column in df.columns:
        cells = [format_cell(v) for v in df[column]]
        header = str(column)
        longest = max(map(len, cells), default=0)
        words = longest if _numeric(df[column], pd) else max(map(_longest_word, cells), default=0)
        full[column] = max(len(header), longest)
        header_wrapped[column] = max(_longest_word(header), longest)
        narrowest[column] = max(_longest_word(header), words, 1)

    def room(columns) -> int:
        return width - EDGES - BETWEEN * (len(columns) - 1)

    def fit(columns) -> list[int]:
        widths = {c: full[c] for c in columns}
        for floor in (header_wrapped, narrowest):  # wrap headers first, then text cells
            while sum(widths.values()) > room(columns):
                slack = max(columns, key=lambda c: widths[c] - max(floor[c], 1))
                if widths[slack] <= floor[slack]:
                    break
                widths[slack] -= 1
        return [widths[c] for c in columns]

    columns = list(df.columns)
    if sum(narrowest[c] for c in columns) <= room(columns) or len(columns) <= keys + 1:
        return [(columns, fit(columns))]
    head, parts, part = columns[:keys], [], []
    for column in columns[keys:]:
        trial = head + part + [column]
        if part and sum(narrowest[c] for c in trial) > room(trial):
            parts.append(head + part)
            part = []
        part.append(column)
    parts.append(head + part)
    return [(part, fit(part)) for part in parts]


def print_view(view: View) -> None:
    """The title (bold), the note (dim, wrapped at the terminal's width), the table: in
    parts of whole columns when it is wider than the terminal (:func:`layout`)."""
    console.print(Text(printable(view.title), style="bold"))
    if view.note:
        console.print(Text(printable(view.note), style="dim"))
    shown = view.shown()
    parts = layout(shown, console.width, view.keys)
    for i, (columns, widths) in enumerate(parts):
        if i:
            keys = ", ".join(map(str, columns[: view.keys]))
            console.print(Text(f"(continued; {keys} repeated)", style="dim"))
        console.print(df_table(shown[columns], widths=widths))


def progress(
    items: Sequence[T] | Iterable[T], description: str, total: int | None = None
) -> Iterator[T]:
    """Iterate with progress on stderr: a bar with count, elapsed time and time left on a
    terminal; otherwise (a log file, CI) one plain line every few seconds."""
    total = total if total is not None else (len(items) if hasattr(items, "__len__") else None)
    if not err_console.is_terminal:
        yield from _plain_progress(items, description, total)
        return
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=err_console, transient=True) as bar:
        task = bar.add_task(description, total=total)
        for item in items:
            yield item
            bar.advance(task)


def _clock(seconds: float) -> str:
    """``1:05`` or ``1:02:05``."""
    minutes, seconds = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}:{seconds:02d}"
    return f"{minutes // 60}:{minutes % 60:02d}:{seconds:02d}"


def progress_line(
    description: str, done: int, total: int | None, elapsed: float, left: float | None = None
) -> str:
    """``fit: 12/40 (30%), 0:35 elapsed, about 1:22 left`` (no estimate without ``left``)."""
    if not total:
        return f"{description}: {done} done, {_clock(elapsed)} elapsed"
    estimate = left is not None and math.isfinite(left) and done < total
    eta = f", about {_clock(left)} left" if estimate else ""
    return f"{description}: {done}/{total} ({done / total:.0%}), {_clock(elapsed)} elapsed{eta}"


class _PlainProgress:
    """The state of one plain progress report: units done and when a line was printed.

    A line comes each time another ``PLAIN_PROGRESS_STEP`` of the units is done (at most
    one per ``PLAIN_PROGRESS_EVERY`` seconds), and a last one at the end if any came
    before. The time left is estimated from the units after the first, which also pays
    for loading and compiling, so an early estimate is not minutes off. A daemon thread
    prints the state again when no line came for ``HEARTBEAT_EVERY`` seconds, so one long
    unit (a replay of every step) is not minutes of silence."""

    def __init__(self, description: str, total: int | None) -> None:
        self.description, self.total = description, total
        self.done = 0
        self.start = self.last = time.monotonic()
        self.first: float | None = None  # when the first unit was done
        self.shown_done = 0  # units done at the last line
        self.printed = False
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        threading.Thread(target=self._heartbeat, daemon=True).start()

    def advance(self) -> None:
        with self.lock:
            self.done += 1
            now = time.monotonic()
            if self.first is None:
                self.first = now
            if self.total:
                step = max(1, math.ceil(PLAIN_PROGRESS_STEP * self.total))
                due = self.done - self.shown_done >= step or self.done == self.total
            else:
                due = True
            if due and now - self.last >= PLAIN_PROGRESS_EVERY:
                self._print()

    def stop(self) -> None:
        with self.lock:  # a line being printed finishes first; none comes after
            if self.printed and self.shown_done != self.done:
                self._print()
            self.stopped.set()

    def _heartbeat(self) -> None:
        while not self.stopped.wait(min(HEARTBEAT_EVERY / 4, 5.0)):
            with self.lock:
                if not self.stopped.is_set() and time.monotonic() - self.last >= HEARTBEAT_EVERY:
                    self._print()

    def _left(self, now: float) -> float | None:
        if not self.total or self.done < 2 or self.first is None:
            return None
        return (now - self.first) / (self.done - 1) * (self.total - self.done)

    def _print(self) -> None:
        self.last = now = time.monotonic()
        self.shown_done, self.printed = self.done, True
        line = progress_line(
            self.description, self.done, self.total, now - self.start, self._left(now)
        )
        err_console.print(line, highlight=False)


def _plain_progress(items: Iterable[T], description: str, total: int | None) -> Iterator[T]:
    report = _PlainProgress(description, total)
    try:
        for item in items:
            yield item
            report.advance()
    finally:
        report.stop()


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
    """One warning line on stderr (the message is plain text, never markup)."""
    err_console.print(f"[yellow]Warning:[/yellow] {escape(printable(message))}", highlight=False)
