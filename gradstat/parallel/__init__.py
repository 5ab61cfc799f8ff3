"""Where an analysis's units run (:func:`run_units`); see docs/architecture.md."""

from gradstat.parallel.progress import Progress, no_progress
from gradstat.parallel.runner import follow, planned_workers, run_units, runs
from gradstat.parallel.units import Task

__all__ = [
    "Progress",
    "Task",
    "follow",
    "no_progress",
    "planned_workers",
    "run_units",
    "runs",
]
