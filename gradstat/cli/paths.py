"""Output paths checked when the command line is parsed, before any analysis runs.

An analysis can take minutes; finding out afterwards that ``--csv``, ``--plot`` or
``--out`` cannot be written wastes them. These are typer option callbacks: they run
while the options are parsed and raise ``UsageError`` (one ``Error:`` line, exit 2).
"""

from __future__ import annotations

import os
from pathlib import Path

from gradstat.errors import UsageError
from gradstat.plots.paths import check_plot_path


def check_writable(path: Path | None, option: str) -> Path | None:
    """``path`` can be created or overwritten as a file; ``None`` (not asked for) passes."""
    if path is None:
        return None
    path = Path(path)
    folder = path.parent
    if path.is_dir():
        raise UsageError(f"{option} {path}: is a folder; give a file name")
    if not folder.exists():
        raise UsageError(f"{option} {path}: folder {folder} does not exist")
    if not folder.is_dir():
        raise UsageError(f"{option} {path}: {folder} is not a folder")
    target = path if path.exists() else folder
    if not os.access(target, os.W_OK):
        raise UsageError(f"{option} {path}: permission denied")
    return path


def csv_path(path: Path | None) -> Path | None:
    """Callback of ``--csv``."""
    return check_writable(path, "--csv")


def plot_path(path: Path | None) -> Path | None:
    """Callback of ``--plot``: a known figure format, in a writable place."""
    return check_writable(check_plot_path(path), "--plot")


def out_path(path: Path | None) -> Path | None:
    """Callback of ``--out`` for files (``recommend``, ``report``)."""
    return check_writable(path, "--out")
