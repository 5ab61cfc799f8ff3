"""The progress hook every analysis takes.

Analyses stay free of terminal code: they accept ``progress``, a function that wraps an
iterable (the CLI passes a rich progress bar; notebooks pass nothing, or ``tqdm``). The
iterable yields once for each part of the work done and its length counts the parts:
for most analyses a part is a unit (a step, a pair of steps); a replay unit has one part
per step (:class:`gradstat.parallel.Task`'s ``parts``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

Progress = Callable[[Iterable], Iterable]


def no_progress(items: Iterable) -> Iterable:
    """The default: iterate without reporting."""
    return items
