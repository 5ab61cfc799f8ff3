"""Which FSDP units reached the row of the current step, and what a row lacking some
becomes (docs/capture.md, "FSDP2"): never a silent loss.

* A unit that did not reduce-scatter (the forward skipped it, or none of its parameters
  got a gradient): its slice is recorded as zeros, as DDP records unused parameters.
* A unit that reduce-scattered only some of its parameters (FSDP does not say which):
  the step is not recorded.
* No unit at all (``capture.step()`` without a backward): the step is not recorded.

Each is one warning naming the unit and the step; later steps with the same fault are
counted and summarised by :meth:`UnitArrivals.close`, so a unit skipped on every other
step does not flood the log.
"""

from __future__ import annotations

import warnings

import torch

from gradstat.capture.fsdp import UnitLayout
from gradstat.errors import GradstatWarning

ZEROS = "recorded as zeros"
DROPPED = "not recorded"
NONE = "not recorded, no backward"

#: Why a row is as it is, by fault (``{units}``: the units at fault).
_WHY = {
    ZEROS: "{units} did not reduce-scatter (not in that step's forward, or none of its "
    "parameters got a gradient): its slice is recorded as zeros, as DDP records unused "
    "parameters",
    DROPPED: "{units} reduce-scattered only some of its parameters (the others got no "
    "gradient in this backward, and FSDP does not say which): the step is not recorded. "
    "model.set_reduce_scatter_unused_params(True) makes FSDP reduce-scatter zeros for "
    "them (and give them zero gradients), which gradstat records",
    NONE: "{units} reduce-scattered (no backward before capture.step()): the step is not "
    "recorded. Call capture.step() once per optimizer step, after the backward",
}


def _units(layouts: list[UnitLayout]) -> str:
    """``FSDP unit a`` or ``FSDP units a, b``; ``no FSDP unit`` for none."""
    if not layouts:
        return "no FSDP unit"
    plural = "units" if len(layouts) > 1 else "unit"
    return f"FSDP {plural} " + ", ".join(layout.name for layout in layouts)


class UnitArrivals:
    """The units of the current row that arrived (whole, or in part), on one rank."""

    def __init__(self, layouts: list[UnitLayout], rank: int) -> None:
        self.layouts = layouts
        self.rank = rank
        self._whole: set[int] = set()
        self._partial: list[UnitLayout] = []
        self._faults: dict[tuple[str, str], list[int]] = {}  # (fault, units) -> steps

    def clear(self) -> None:
        """A new row (or a restarted one): no unit has arrived."""
        self._whole.clear()
        self._partial.clear()

    def seen(self, layout: UnitLayout) -> bool:
        """Whether ``layout`` already arrived in this row (a second backward)."""
        return id(layout) in self._whole or any(p is layout for p in self._partial)

    def arrived(self, layout: UnitLayout, whole: bool) -> None:
        if whole:
            self._whole.add(id(layout))
        else:
            self._partial.append(layout)

    def finish(self, row: torch.Tensor, step: int) -> bool:
        """At ``capture.step()``: zeros in the slices of recorded units that did not
        arrive; False when the row must not be written (a unit arrived in part)."""
        if self._partial:
            self._fault(DROPPED, _units(self._partial), step)
            return False
        missing = [
            layout for layout in self.layouts if layout.records and id(layout) not in self._whole
        ]
        for layout in missing:
            layout.zero_into(row)
        if missing:
            self._fault(ZEROS, _units(missing), step)
        return True

    def finish_empty(self, step: int) -> None:
        """At ``capture.step()`` on a recorded step that no unit reached: a warning."""
        self._fault(NONE, _units([]), step)

    def _fault(self, fault: str, units: str, step: int) -> None:
        steps = self._faults.setdefault((fault, units), [])
        steps.append(step)
        if len(steps) == 1:
            warnings.warn(
                f"gradstat (rank {self.rank}): step {step}: {_WHY[fault].format(units=units)}; "
                "later steps like it are summarised when the capture closes",
                GradstatWarning,
                stacklevel=4,
            )

    def close(self) -> None:
        """One warning for each fault seen at more than one step, with those steps."""
        for (fault, units), steps in self._faults.items():
            if len(steps) > 1:
                shown = ", ".join(str(s) for s in steps[:20])
                more = f" and {len(steps) - 20} more" if len(steps) > 20 else ""
                warnings.warn(
                    f"gradstat (rank {self.rank}): {units}: {len(steps)} steps {fault} "
                    f"({shown}{more})",
                    GradstatWarning,
                    stacklevel=3,
                )
        self._faults.clear()
