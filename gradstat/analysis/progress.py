"""The progress hook every analysis takes.

Analyses stay free of terminal code: they accept ``progress``, a function that wraps the
iterable of completed units (the CLI passes a rich progress bar; notebooks pass nothing).
Its length is the number of units. Where a unit has several parts (a replay unit: every
step of its compressors), the iterable also has an ``on_tick`` attribute: a display that
sets it to a function of no arguments (before asking the length, which then counts
parts) has it called once for each part done before a unit completes, and each completed
unit counts as its last part. A display that leaves it (``tqdm``) moves once a unit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

Progress = Callable[[Iterable], Iterable]


def no_progress(items: Iterable) -> Iterable:
    """The default: iterate without reporting."""
    return items
