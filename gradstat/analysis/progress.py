"""The progress hook every analysis takes.

Analyses stay free of terminal code: they accept ``progress``, a function that wraps the
iterable of steps (the CLI passes a rich progress bar; notebooks pass nothing).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

Progress = Callable[[Iterable], Iterable]


def no_progress(items: Iterable) -> Iterable:
    """The default: iterate without reporting."""
    return items
