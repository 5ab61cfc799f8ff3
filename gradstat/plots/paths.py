"""Checking a figure's path before any work; no matplotlib import, so the command line
can validate ``--plot`` without paying for it."""

from __future__ import annotations

from pathlib import Path

from gradstat.errors import UsageError

FORMATS = (".png", ".pdf", ".svg")


def check_plot_path(path: Path | str | None) -> Path | None:
    """Fail early when the suffix is not png, pdf or svg or the folder is missing;
    ``None`` (no plot asked for) passes."""
    if path is None:
        return None
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise UsageError(f"--plot {path}: the suffix must be one of {', '.join(FORMATS)}")
    if path.parent and not path.parent.exists():
        raise UsageError(f"--plot {path}: folder {path.parent} does not exist")
    return path
