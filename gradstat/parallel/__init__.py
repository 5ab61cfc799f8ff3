"""Where an analysis's units run: a loop, ``--jobs`` worker processes, torchrun ranks.

See :func:`run_units` (the runner), :mod:`~gradstat.parallel.threads` (the thread
policy) and :mod:`~gradstat.parallel.distributed` (torchrun).
"""

from importlib import import_module

#: Each name's module, imported on first use (both import torch; the command line's
#: start-up reads :mod:`~gradstat.parallel.environment` and needs neither).
_HOMES = {
    "planned_workers": "gradstat.parallel.runner",
    "run_units": "gradstat.parallel.runner",
    "available_cpus": "gradstat.parallel.threads",
    "default_jobs": "gradstat.parallel.threads",
}


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'gradstat.parallel' has no attribute {name!r}")
    value = getattr(import_module(home), name)
    globals()[name] = value
    return value


__all__ = sorted(_HOMES)
