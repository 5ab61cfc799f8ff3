"""Every analysis as independent units of work, run in unit order.

An analysis plans its work as a :class:`Work` (a module-level unit function and the
small, JSON-able context it needs: the capture's path, the :class:`Selection` and the
parsed parameters) and a list of units (a step, a pair of steps, a group of compressor
configurations; each analysis says which). ``work.function(cap, selection, params,
compute, unit)`` returns the unit's records (``list[dict]``); :func:`run_units` returns
every unit's records in unit order, so the analysis builds the same table however the
units were run. Units never share state, so the runner (:func:`gradstat.parallel.run_units`)
hands them to ``--jobs`` worker processes or to torchrun ranks, which open the capture
from ``work.capture`` themselves and receive the context as typed JSON.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gradstat.analysis.compute import Compute
from gradstat.analysis.selection import Selection
from gradstat.store import Capture

UnitFunction = Callable[[Capture, Selection, Any, Compute, Any], list[dict]]


@dataclass(frozen=True)
class Work:
    """One analysis's unit function and its context (module docstring). ``cost``: its
    compute per byte of gradients read, in passes over them (1: about one pass, as the
    top-k set analyses); the runner starts worker processes only where the selected
    bytes times ``cost`` pay for their start. ``parts``: how many parts of its work a unit
    reports done (:func:`~gradstat.parallel.units.unit_progress`), so that progress moves
    within a long unit (a replay unit: its steps)."""

    function: UnitFunction
    capture: str
    selection: Selection
    params: Any
    cost: float = 1.0
    parts: int = 1
