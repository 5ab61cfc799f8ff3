"""An analysis as units of work (:class:`Task`), each run alike in every process.

``task.function(cap, selection, params, compute, unit)`` returns a unit's records; with
``parts > 1`` (or None: a part per item of the unit, e.g. a run of steps) it also gets
``tick=``, called once per part done (a step), which moves progress and stops the unit
on Ctrl-C. :func:`finish` re-emits warnings
once each and raises the first error, in unit order, as one process would."""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from gradstat import cancel


@dataclass(frozen=True)
class Task:
    """A module-level unit function and its context: the capture's path (other processes
    open it), frozen ``selection`` and ``params``; ``parts``: ticks a unit reports (None:
    one per item of the unit)."""

    function: Callable[..., list[dict]]
    capture: str
    selection: Any
    params: Any
    parts: int | None = 1


@dataclass
class Outcome:
    """One unit's records, or the exception that stopped it, and its warnings."""

    records: list[dict] = field(default_factory=list)
    warnings: list[tuple[type[Warning], str]] = field(default_factory=list)
    error: BaseException | None = None

    def portable(self) -> Outcome:
        """Safe to pickle: an exception that does not pickle becomes a RuntimeError."""
        try:
            pickle.loads(pickle.dumps(self.error))
        except Exception:
            self.error = RuntimeError(f"{type(self.error).__name__}: {self.error}")
        return self


def run_unit(task: Task, cap: Any, compute: Any, unit: Any, tick: Callable[[], None]) -> Outcome:
    """Run one unit of ``task`` on the open capture ``cap``."""
    outcome = Outcome()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            cancel.check()
            extra = {"tick": tick} if task.parts != 1 else {}
            outcome.records = task.function(
                cap, task.selection, task.params, compute, unit, **extra
            )
        except Exception as exc:  # travels as data; finish() raises it
            outcome.error = exc
    outcome.warnings = [(w.category, str(w.message)) for w in caught]
    return outcome


def finish(outcomes: Iterable[Outcome]) -> list[dict]:
    """All records in order, after each distinct warning once; the first error raised."""
    records: list[dict] = []
    seen: set[tuple[type[Warning], str]] = set()
    for outcome in outcomes:
        for category, message in outcome.warnings:
            if (category, message) not in seen:
                seen.add((category, message))
                warnings.warn(message, category, stacklevel=3)
        if outcome.error is not None:
            raise outcome.error
        records.extend(outcome.records)
    return records
