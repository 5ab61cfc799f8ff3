"""Where an analysis's units run (:func:`run_units`); see docs/architecture.md."""

from gradstat.parallel.runner import follow, planned_workers, run_units
from gradstat.parallel.units import Task

__all__ = ["Task", "follow", "planned_workers", "run_units"]
