"""``run_units``: an analysis's units in a loop, in ``--jobs`` processes or across ranks.

Every analysis is written as per-unit work (:mod:`gradstat.parallel.units`); this
module decides where the units run:

* one process, ``jobs=1`` (or a single unit): a plain loop in this process;
* ``jobs=N``: N worker processes on this machine (:mod:`gradstat.parallel.pool`);
* under torchrun (:mod:`gradstat.parallel.distributed`): rank r computes the r-th
  contiguous run of the units (each rank with its own ``--jobs`` workers), rank 0
  gathers them.

Whatever the mode, records come back in unit order, pass through the same JSON
encoding, and warnings and the first error surface as one process would show them, so
the results are identical. Units run on :func:`~gradstat.parallel.threads.unit_threads`
torch threads (one by default: the thread policy). The memory budget
(``Compute.memory``) is shared by the processes of a node: each worker and each local
rank gets its part.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

from gradstat.analysis.progress import Progress, no_progress
from gradstat.parallel import distributed
from gradstat.parallel.codec import from_typed, to_typed
from gradstat.parallel.pool import run_pool
from gradstat.parallel.threads import (
    check_jobs,
    local_processes,
    torch_threads,
    unit_threads,
)
from gradstat.parallel.units import Task, finish
from gradstat.store import Capture

#: The smallest row budget a worker is given (1 MiB: 16 rows of the smallest block).
MIN_WORKER_MEMORY = 1 << 20


#: Below this many bytes of selected gradients (times the analysis's cost in passes per
#: byte) an analysis runs in one process by default: starting a worker (a fresh
#: interpreter importing torch) costs about 2 s of CPU, and on a loaded machine far more
#: wall time (measured: similarity of 128 MiB took 3.1 s in one process, 52 s with two
#: fresh workers, at a load average of 20 on 2 cores).
PARALLEL_MIN_BYTES = 1 << 30


def requested_jobs(cap: Capture, selection: Any, jobs: int | None, cost: float = 1.0) -> int | None:
    """Worker processes per rank: ``jobs`` if given; one for a small selection (bytes x
    ``cost`` under ``PARALLEL_MIN_BYTES``); else ``None``: each rank's share of its CPUs."""
    if jobs is not None:
        return check_jobs(jobs)
    steps = len(getattr(selection, "steps", None) or cap.steps)
    learners = len(getattr(selection, "learners", None) or cap.learners)
    return 1 if cap.numel * learners * steps * 4 * cost < PARALLEL_MIN_BYTES else None


def planned_workers(cap: Capture, selection: Any, jobs: int | None, cost: float = 1.0) -> int:
    """How many processes will run units at once: ranks x jobs per rank (an analysis may
    group its work into this many units, as replay does with its configurations)."""
    return distributed.world_size() * check_jobs(requested_jobs(cap, selection, jobs, cost))


def run_units(
    cap: Capture, work: Any, units: Sequence[Any], compute: Any, progress: Progress = no_progress
) -> list[dict]:
    """The records of every unit, in unit order.

    ``work`` has the unit ``function``, the ``capture`` path, the ``selection`` and the
    ``params`` (``gradstat.analysis.units.Work``); each unit's records are
    ``work.function(cap, selection, params, compute, unit)``. ``compute.jobs`` worker
    processes per rank (None: :func:`requested_jobs`). ``progress`` wraps the completions
    of this process's units: ``work.parts`` a unit, each part reported by the unit
    (:func:`~gradstat.parallel.units.unit_progress`) or, the rest, when it completes.
    """
    jobs = requested_jobs(cap, work.selection, getattr(compute, "jobs", None), work.cost)
    task = Task(work.function, str(work.capture), work.selection, work.params, compute, cap)
    request = {
        "task": task.to_message(),
        "units": to_typed(list(units)),
        "jobs": jobs,
        "parts": getattr(work, "parts", 1),
    }
    if distributed.active():
        outcomes = distributed.exchange(request, lambda r: compute_share(r, progress, task))
    else:
        outcomes = compute_share(request, progress, task)
    return finish(_in_order(outcomes, len(units)))


def compute_share(
    request: dict, progress: Progress = no_progress, task: Task | None = None
) -> dict[int, dict]:
    """This rank's units of ``request``: outcome by unit index. ``task``: the request's
    task as objects already in this process (rank 0); else built from the message."""
    units = from_typed(request["units"])
    mine = distributed.share(len(units))
    jobs = check_jobs(request["jobs"])
    own = task is None
    if task is None:
        task = Task.from_message(request["task"])
    try:
        completions = _Completions(len(mine), request.get("parts", 1))
        runs = _run(task, request["task"], units, mine, jobs, completions, keep_exception=not own)
        return {index: outcome for index, outcome in progress(completions.of(runs))}
    finally:
        if own:
            task.close()


def _run(
    task: Task,
    message: dict,
    units: list,
    mine: list[int],
    jobs: int,
    completions: _Completions,
    *,
    keep_exception: bool,
) -> Iterator[tuple[int, dict]]:
    threads = unit_threads()
    if jobs == 1 or len(mine) <= 1:
        task.compute = _share_compute(task.compute, 1)
        with torch_threads(threads):
            for index in mine:
                tick = partial(completions.tick, index)
                outcome = task.run(units[index], keep_exception=keep_exception, tick=tick)
                yield index, outcome
                if "error" in outcome:
                    return
        return
    workers = min(jobs, len(mine))
    worker_task = {**message, "compute": to_typed(_share_compute(task.compute, workers))}
    chosen = [to_typed(units[i]) for i in mine]

    def tick(position: int) -> None:
        completions.tick(mine[position])

    for position, outcome in run_pool(worker_task, chosen, workers, threads, tick):
        yield mine[position], outcome
        if "error" in outcome:
            return


def _share_compute(compute: Any, workers: int) -> Any:
    """``compute`` for one of ``workers`` processes of this rank: one job, its share of
    the memory budget (split over this node's ranks too)."""
    if not dataclasses.is_dataclass(compute):
        return compute
    changes: dict[str, Any] = {}
    if hasattr(compute, "jobs"):
        changes["jobs"] = 1
    processes = workers * local_processes()
    if hasattr(compute, "memory_bytes") and processes > 1:
        changes["memory"] = max(MIN_WORKER_MEMORY, compute.memory_bytes() // processes)
    return dataclasses.replace(compute, **changes)


def _in_order(outcomes: dict[int, dict], count: int) -> Iterator[dict]:
    """Outcomes by unit index; where units are missing (their runs stopped at an error),
    the first failed unit's outcome instead."""
    for index in range(count):
        if index not in outcomes:
            yield outcomes[min(i for i, o in outcomes.items() if "error" in o)]
            return
        yield outcomes[index]


class _Completions:
    """This process's units as they complete, for progress displays
    (:mod:`gradstat.analysis.progress`): ``units`` units of ``parts`` parts each. Each
    completion is an item (of :meth:`of`); a display that sets ``on_tick`` to its own
    advance is also told of each part before a unit completes, and the length then
    counts parts instead of units."""

    def __init__(self, units: int, parts: int) -> None:
        self.units, self.parts = units, max(1, int(parts))
        self.on_tick: Callable[[], None] | None = None
        self._ticked: dict[int, int] = {}  # parts reported so far, by unit index

    def __len__(self) -> int:
        return self.units * self.parts if self.on_tick is not None else self.units

    def tick(self, index: int) -> None:
        """Unit ``index`` reported a part done: one step of the bar, except its last
        part, which its completion counts."""
        if self._ticked.get(index, 0) < self.parts - 1:
            self._ticked[index] = self._ticked.get(index, 0) + 1
            if self.on_tick is not None:
                self.on_tick()

    def of(self, runs: Iterator[tuple[int, dict]]) -> _Completions:
        """These completions, of ``runs`` (the units' outcomes as they finish)."""
        self._runs = runs
        return self

    def __iter__(self) -> Iterator[tuple[int, dict]]:
        for index, outcome in self._runs:
            while self._ticked.get(index, 0) < self.parts - 1:  # parts it did not report
                self.tick(index)
            yield index, outcome
