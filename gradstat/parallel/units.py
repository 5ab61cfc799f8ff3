"""One unit of an analysis, run the same way in every process: errors and warnings as data.

An analysis plans its work as a unit function (module-level) and a small context: the
capture's path, the :class:`~gradstat.analysis.selection.Selection`, its parameters and
the :class:`~gradstat.analysis.compute.Compute` (``gradstat.analysis.units.Work``).
``function(cap, selection, params, compute, unit)`` returns the unit's records. Worker
processes and torchrun ranks receive the context as a :class:`Task` (typed JSON,
:mod:`gradstat.parallel.codec`), find the function again by its ``module:name`` and open
the capture themselves. Whatever the process, a unit's outcome is a plain dict:
``{"records": [...], "warnings": [[category, message], ...]}`` or ``{"error": {"type":
..., "message": ...}, "warnings": [...]}``, so that the caller re-raises the first error
and re-emits warnings once each, in unit order, exactly as one process would.
"""

from __future__ import annotations

import builtins
import importlib
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from gradstat import errors
from gradstat.parallel.codec import from_typed, roundtrip, to_typed
from gradstat.store import Capture, open_capture

UnitFunction = Callable[[Capture, Any, Any, Any, Any], list[dict]]
#: What :func:`unit_progress` calls while :meth:`Task.run` runs a unit (None otherwise).
_tick: Callable[[], None] | None = None


def unit_progress() -> None:
    """Say that the running unit has done one more part of its work (a replay unit: one
    step), so that a progress bar moves during a long unit; the analysis declares how
    many parts a unit has (``Work.parts``). Does nothing outside :meth:`Task.run`."""
    if _tick is not None:
        _tick()


def function_name(function: UnitFunction) -> str:
    """``module:name`` of a module-level unit function (what other processes import)."""
    name = getattr(function, "__qualname__", "")
    module = getattr(function, "__module__", "")
    if not module or not name or "<" in name or "." in name:
        raise TypeError(f"{function!r}: a unit function must be a module-level function")
    return f"{module}:{name}"


def resolve_function(name: str) -> UnitFunction:
    """The unit function named ``module:name`` (gradstat's own modules only)."""
    module, _, attribute = name.partition(":")
    if module != "gradstat" and not module.startswith("gradstat."):
        raise ValueError(f"refusing to run {name!r}: not a gradstat unit function")
    return getattr(importlib.import_module(module), attribute)


@dataclass
class Task:
    """A unit function with its context, as one process runs it (see the module docstring).

    ``cap`` is opened from ``capture`` on first use where the task was received."""

    function: UnitFunction
    capture: str
    selection: Any
    params: Any
    compute: Any
    cap: Capture | None = None

    def to_message(self) -> dict:
        return {
            "function": function_name(self.function),
            "capture": self.capture,
            "selection": to_typed(self.selection),
            "params": to_typed(self.params),
            "compute": to_typed(self.compute),
        }

    @classmethod
    def from_message(cls, message: dict) -> Task:
        return cls(
            resolve_function(message["function"]),
            message["capture"],
            from_typed(message["selection"]),
            from_typed(message["params"]),
            from_typed(message["compute"]),
        )

    def run(
        self, unit: Any, *, keep_exception: bool = False, tick: Callable[[], None] | None = None
    ) -> dict:
        """Run one unit: its records (JSON round-tripped), warnings and error as a dict.

        ``keep_exception`` (in-process loops only) keeps the exception object itself
        under ``"exception"``, so it is re-raised with its traceback (``GRADSTAT_DEBUG=1``).
        ``tick``: called for each part of the unit done (:func:`unit_progress`).
        """
        global _tick
        _tick = tick
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                if self.cap is None:
                    self.cap = open_capture(self.capture)
                records = self.function(self.cap, self.selection, self.params, self.compute, unit)
                outcome: dict = {"records": roundtrip(records)}
            except Exception as exc:  # travels as data; the caller re-raises it
                outcome = {"error": {"type": type(exc).__name__, "message": str(exc)}}
                if keep_exception:
                    outcome["exception"] = exc
            finally:
                _tick = None
        outcome["warnings"] = [[w.category.__name__, str(w.message)] for w in caught]
        return outcome

    def close(self) -> None:
        """Close the capture this task opened itself."""
        if self.cap is not None:
            self.cap.close()
            self.cap = None


def _exception_class(name: str) -> type[Exception]:
    found = getattr(errors, name, None) or getattr(builtins, name, None)
    if isinstance(found, type) and issubclass(found, Exception):
        return found
    return RuntimeError


def raise_error(error: dict) -> None:
    """Raise a unit's error again in this process: the same type where it is a gradstat
    or built-in exception, else a ``RuntimeError`` naming the original type."""
    cls, message = _exception_class(error["type"]), error["message"]
    if cls.__name__ != error["type"]:
        message = f"{error['type']}: {message}"
    try:
        exc = cls(message)
    except Exception:  # an exception type that wants other arguments
        exc = RuntimeError(f"{error['type']}: {error['message']}")
    raise exc


def _warning_class(name: str) -> type[Warning]:
    found = getattr(errors, name, None) or getattr(builtins, name, None)
    if isinstance(found, type) and issubclass(found, Warning):
        return found
    return UserWarning


def finish(outcomes: Iterable[dict]) -> list[dict]:
    """The records of ``outcomes`` (in unit order), after re-emitting each distinct warning
    once and raising the first unit's error."""
    records: list[dict] = []
    seen: set[tuple[str, str]] = set()
    for outcome in outcomes:
        for category, message in outcome["warnings"]:
            if (category, message) not in seen:
                seen.add((category, message))
                warnings.warn(message, _warning_class(category), stacklevel=3)
        if "exception" in outcome:
            raise outcome["exception"]
        if "error" in outcome:
            raise_error(outcome["error"])
        records.extend(outcome["records"])
    return records
