"""``--jobs N``: N spawned workers, each running one contiguous run of the units on
``threads`` torch threads, with a pipe each way: events (pickled, between gradstat's
processes only) come back on one; a worker ends when the other reads as closed: closed
by the parent to stop it, or by the kernel as the parent dies (SIGKILL too)."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait
from typing import Any

from gradstat import cancel
from gradstat.errors import GradstatError
from gradstat.parallel.units import Outcome, Task, run_unit
from gradstat.store import open_capture
from gradstat.threads import torch_threads


class WorkerDied(GradstatError):
    """A worker process stopped without answering (killed, out of memory)."""


def run_pool(
    task: Task, compute: Any, chunks: list[list[tuple[int, Any]]], threads: int
) -> Iterator[tuple[int, Any]]:
    """Each chunk in its own worker; yields ``(index, None)`` per part, ``(index, outcome)``."""
    context = multiprocessing.get_context("spawn")
    workers: dict[Connection, list] = {}  # events pipe: [process, stop pipe, outcomes owed]
    try:
        for chunk in chunks:
            (events, events_end), (stop_end, stop) = context.Pipe(False), context.Pipe(False)
            args = (task, compute, chunk, events_end, stop_end, threads)
            process = context.Process(target=_work, args=args, daemon=True)
            process.start()
            events_end.close()  # the worker's ends: only the worker holds them now
            stop_end.close()
            workers[events] = [process, stop, len(chunk)]
        while any(owed for _, _, owed in workers.values()):
            cancel.check()  # a stopping signal: the finally below stops the workers
            for pipe in wait([p for p, w in workers.items() if w[2]], timeout=0.1):
                try:
                    index, data = pipe.recv()
                except (EOFError, OSError):  # its exit code: -N if killed by signal N
                    code = workers[pipe][0].join(5) or workers[pipe][0].exitcode
                    raise WorkerDied(f"a --jobs worker process stopped (exit {code})") from None
                outcome = None if data is None else pickle.loads(data)
                if outcome is not None:  # an error ends the worker's run of units
                    workers[pipe][2] = 0 if outcome.error is not None else workers[pipe][2] - 1
                yield index, outcome
    finally:
        for process, stop, _ in workers.values():
            stop.close()  # the worker ends at once; one that lingers is killed
            process.join(5)
            process.kill()
            process.join()


def _work(task: Task, compute: Any, chunk: list, events: Connection, stop: Connection, threads):
    """A worker: end when the stop pipe reads as closed (stopped, or the parent is gone);
    run the chunk, sending events. The parent handles the signals."""
    cancel.follow_event(None)
    threading.Thread(target=lambda: wait([stop]) and os._exit(0), daemon=True).start()
    try:
        cap = open_capture(task.capture)
    except Exception as exc:  # the first unit's error, as in one process
        events.send((chunk[0][0], pickle.dumps(Outcome(error=exc).portable())))
        return
    with cap, torch_threads(threads):
        for index, unit in chunk:

            def tick(index: int = index) -> None:
                cancel.check()
                events.send((index, None))

            outcome = run_unit(task, cap, compute, unit, tick).portable()
            events.send((index, pickle.dumps(outcome)))
            if outcome.error is not None:
                return
