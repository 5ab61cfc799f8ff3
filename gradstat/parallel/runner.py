"""``run_units``: an analysis's units in this process (the default, measured fastest:
docs/large.md), in ``--jobs`` workers (:mod:`~gradstat.parallel.pool`) or across torchrun
ranks (:mod:`~gradstat.parallel.distributed`), with the same records, warnings and
errors in every mode. In this process the units run in a thread: the main thread stays
free for progress and Ctrl-C."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import queue
import threading
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from gradstat import cancel
from gradstat.parallel import distributed
from gradstat.parallel.pool import run_pool
from gradstat.parallel.progress import Progress, no_progress
from gradstat.parallel.units import Outcome, Task, finish, run_unit
from gradstat.store import open_capture
from gradstat.threads import local_processes, torch_threads, unit_threads


class Request(NamedTuple):
    """What a process needs to compute its share of the units."""

    task: Task
    units: tuple
    jobs: int
    compute: Any


def planned_workers(cap: Any, selection: Any, jobs: int | None) -> int:
    """Processes that will run units at once: ranks x jobs per rank (None: one)."""
    return distributed.world_size() * (jobs or 1)


def runs(items: Sequence[Any], workers: int) -> list[tuple]:
    """``items`` in at most ``workers`` contiguous runs of nearly equal length, in order:
    the units of an analysis that keeps state from item to item (its buffers, a row read
    ahead, the last steps' sets), one run per process (:func:`planned_workers`)."""
    workers = max(1, min(workers, len(items)))
    bounds = itertools.pairwise(len(items) * w // workers for w in range(workers + 1))
    return [tuple(items[a:b]) for a, b in bounds]


def run_units(
    cap: Any, task: Task, units: Sequence[Any], compute: Any, progress: Progress = no_progress
) -> list[dict]:
    """Every unit's records, in unit order. ``compute.jobs``: worker processes per rank
    (None: this process); ``progress`` wraps an iterable of parts done (``task.parts``
    per unit of this process)."""
    request = Request(task, tuple(units), getattr(compute, "jobs", None) or 1, compute)
    if distributed.active():
        outcomes = distributed.exchange(request, lambda r: _share(r, progress, cap))
    else:
        outcomes = _share(request, progress, cap)
    ordered = [outcomes[i] for i in itertools.takewhile(outcomes.__contains__, range(len(units)))]
    errors = [o for _, o in sorted(outcomes.items()) if o.error is not None]
    if len(ordered) < len(units) and not errors:  # never a silent partial table
        raise RuntimeError(f"{len(units) - len(ordered)} units ended without an outcome")
    return finish(ordered + errors[:1])  # units are missing only after an error


def follow(request: Request) -> dict[int, Outcome]:
    """A following torchrun rank's answer to ``request``: its share's outcomes."""
    with open_capture(request.task.capture) as cap:
        return {i: outcome.portable() for i, outcome in _share(request, cap=cap).items()}


def _share(request: Request, progress: Progress = no_progress, cap: Any = None) -> dict:
    mine = distributed.share(len(request.units))
    workers = min(request.jobs, len(mine))
    compute = _share_compute(request.compute, max(1, workers))
    if workers <= 1:
        source = _in_thread(request.task, compute, [(i, request.units[i]) for i in mine], cap)
    else:
        bounds = itertools.pairwise(len(mine) * w // workers for w in range(workers + 1))
        chunks = [[(i, request.units[i]) for i in mine[a:b]] for a, b in bounds]
        source = run_pool(request.task, compute, chunks, unit_threads())
    task = request.task
    parts = _Parts(
        {i: len(request.units[i]) if task.parts is None else task.parts for i in mine}, source
    )
    with cancel.listening():
        for _ in progress(parts):
            pass
    return parts.outcomes


def _in_thread(task: Task, compute: Any, chunk: list, cap: Any) -> Iterator[tuple[int, Any]]:
    """Run ``chunk`` in a thread of this process; yield its events (see ``run_pool``)."""
    events: queue.SimpleQueue = queue.SimpleQueue()

    def work() -> None:
        try:
            with torch_threads(unit_threads()):
                for index, unit in chunk:

                    def tick(index: int = index) -> None:
                        cancel.check()
                        events.put((index, None))

                    outcome = run_unit(task, cap, compute, unit, tick)
                    events.put((index, outcome))
                    if outcome.error is not None:
                        break
        finally:
            events.put(None)

    thread = threading.Thread(target=work, name="gradstat-units", daemon=True)
    thread.start()
    try:
        while True:  # Ctrl-C is raised here; the unit stops at its next check
            cancel.check()
            with contextlib.suppress(queue.Empty):
                if (event := events.get(timeout=0.1)) is None:
                    return
                yield event
    finally:
        thread.join()


def _share_compute(compute: Any, workers: int) -> Any:
    """``compute`` of one of ``workers`` processes: one job, its share of the memory."""
    if not dataclasses.is_dataclass(compute):
        return compute
    processes = workers * local_processes()
    memory = compute.memory_bytes() // processes if processes > 1 else compute.memory
    return dataclasses.replace(compute, jobs=1, memory=max(1 << 20, memory) if memory else None)


class _Parts:
    """What a progress display wraps: one item per part done, ``parts[i]`` for unit i. A
    unit's end counts its parts it did not report; :attr:`outcomes` collects the ends."""

    def __init__(self, parts: dict[int, int], source: Iterator[tuple[int, Any]]) -> None:
        self.parts, self.source = {i: max(1, n) for i, n in parts.items()}, source
        self.outcomes: dict[int, Outcome] = {}
        self._done: dict[int, int] = {}

    def __len__(self) -> int:
        return sum(self.parts.values())

    def __iter__(self) -> Iterator[int]:
        for index, outcome in self.source:
            done, total = self._done.get(index, 0), self.parts[index]
            step = int(done < total - 1) if outcome is None else total - done
            self._done[index] = done + step
            yield from [index] * step
            if outcome is not None:
                self.outcomes[index] = outcome
                if outcome.error is not None:
                    return
