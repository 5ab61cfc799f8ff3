"""Where an analysis's units run: a loop, ``--jobs`` worker processes, torchrun ranks.

See :func:`run_units` (the runner), :mod:`~gradstat.parallel.threads` (the thread
policy) and :mod:`~gradstat.parallel.distributed` (torchrun).
"""

from gradstat.parallel.runner import planned_workers, run_units
from gradstat.parallel.threads import available_cpus, default_jobs

__all__ = ["available_cpus", "default_jobs", "planned_workers", "run_units"]
