"""``--jobs N``: N spawned ``concurrent.futures`` workers, each running one contiguous
run of the units (neighbouring step pairs meet in one process) on ``threads`` torch
threads; they ignore SIGINT and stop at their next check once the parent sets the stop
event. Tasks and outcomes are pickled between these processes only."""

from __future__ import annotations

import multiprocessing
import pickle
import queue
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from gradstat import cancel
from gradstat.errors import GradstatError
from gradstat.parallel.units import Task, run_unit

_events: list[Any] = []  # in a worker: the queue its events go to


class WorkerDied(GradstatError):
    """A worker process stopped without answering (killed, out of memory)."""


def run_pool(
    task: Task, compute: Any, chunks: list[list[tuple[int, Any]]], threads: int
) -> Iterator[tuple[int, Any]]:
    """Run each chunk of ``(index, unit)`` in its own worker; yield ``(index, None)`` for
    each part a unit reports and ``(index, outcome)`` when it ends."""
    context = multiprocessing.get_context("spawn")
    events, stop = context.Queue(), context.Event()
    chunk_of = {index: c for c, chunk in enumerate(chunks) for index, _ in chunk}
    left = [len(chunk) for chunk in chunks]  # outcomes each chunk still owes
    with ProcessPoolExecutor(len(chunks), context, _start, (events, stop, threads)) as pool:
        futures = [pool.submit(_run_chunk, task, compute, chunk) for chunk in chunks]
        try:
            while any(left):
                cancel.check()  # on Ctrl-C, the workers stop at the stop event
                try:
                    index, data = events.get(timeout=0.1)
                except queue.Empty:
                    _check(futures)
                    continue
                outcome = None if data is None else pickle.loads(data)
                if outcome is not None:
                    c = chunk_of[index]
                    left[c] = 0 if outcome.error is not None else left[c] - 1
                yield index, outcome
        finally:
            stop.set()


def _check(futures: list) -> None:
    for future in futures:
        if future.done() and future.exception() is not None:
            raise WorkerDied(f"a --jobs worker process stopped: {future.exception()}")


def _start(events: Any, stop: Any, threads: int) -> None:
    import torch

    cancel.follow_event(stop)
    torch.set_num_threads(threads)
    _events.append(events)


def _run_chunk(task: Task, compute: Any, chunk: list[tuple[int, Any]]) -> None:
    from gradstat.store import open_capture

    events = _events[0]
    with open_capture(task.capture) as cap:
        for index, unit in chunk:

            def tick(index: int = index) -> None:
                cancel.check()
                events.put((index, None))

            outcome = run_unit(task, cap, compute, unit, tick).portable()
            events.put((index, pickle.dumps(outcome)))
            if outcome.error is not None:
                return
