"""``--jobs N``: N spawned worker processes, each running one contiguous run of the units
(neighbouring step pairs meet in one process) on ``threads`` torch threads.

Each worker is a ``multiprocessing`` process (spawn) with two pipes of its own: it sends
its events (a part done, a unit's outcome, pickled between these processes only) on
one, and watches the other, its *stop pipe*, which the parent closes to stop it. A
closed pipe reads as end-of-file also when the parent dies, SIGKILL included, so a
worker ends with its parent however the parent ends: a thread of the worker waits on
the stop pipe and ends the process at once, and its units also stop at their next
check (:func:`gradstat.cancel.follow_event`). The workers ignore Ctrl-C, SIGTERM and
SIGHUP: the parent handles them and closes the stop pipes. No queue or event with a
semaphore is used, so no resource stays registered with multiprocessing's resource
tracker, which then ends with the last of these processes.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from gradstat import cancel
from gradstat.errors import GradstatError
from gradstat.parallel.units import Outcome, Task, run_unit

#: Seconds a stopped worker may take to end before it is killed.
STOP_SECONDS = 5.0


class WorkerDied(GradstatError):
    """A worker process stopped without answering (killed, out of memory)."""


@dataclass
class _Worker:
    """One worker process, its events pipe and its stop pipe, and the outcomes it owes."""

    process: Any
    events: Connection
    stop: Connection
    owed: int

    def close(self) -> None:
        """Stop the worker (close its stop pipe) and wait for it; kill it if it lingers."""
        with contextlib.suppress(OSError):
            self.stop.close()
        self.process.join(STOP_SECONDS)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.events.close()


def run_pool(
    task: Task, compute: Any, chunks: list[list[tuple[int, Any]]], threads: int
) -> Iterator[tuple[int, Any]]:
    """Run each chunk of ``(index, unit)`` in its own worker; yield ``(index, None)`` for
    each part a unit reports and ``(index, outcome)`` when it ends."""
    context = multiprocessing.get_context("spawn")
    workers: list[_Worker] = []
    try:
        for chunk in chunks:
            events, events_end = context.Pipe(duplex=False)
            stop_end, stop = context.Pipe(duplex=False)
            process = context.Process(
                target=_work,
                args=(task, compute, chunk, events_end, stop_end, threads),
                name="gradstat-jobs",
                daemon=True,
            )
            process.start()
            events_end.close()  # the worker's ends: only the worker holds them now
            stop_end.close()
            workers.append(_Worker(process, events, stop, len(chunk)))
        yield from _follow(workers)
    finally:
        for worker in workers:
            worker.close()


def _follow(workers: list[_Worker]) -> Iterator[tuple[int, Any]]:
    """The workers' events until each has sent its outcomes (or one sent an error)."""
    by_pipe = {worker.events: worker for worker in workers}
    while any(worker.owed for worker in workers):
        cancel.check()  # a stopping signal: the finally of run_pool stops the workers
        waiting = [pipe for pipe, worker in by_pipe.items() if worker.owed]
        for pipe in wait(waiting, timeout=0.1):
            worker = by_pipe[pipe]
            try:
                index, data = pipe.recv()
            except (EOFError, OSError):
                worker.process.join(STOP_SECONDS)
                raise WorkerDied(_death(worker.process.exitcode)) from None
            outcome = None if data is None else pickle.loads(data)
            if outcome is not None:
                worker.owed = 0 if outcome.error is not None else worker.owed - 1
            yield index, outcome


def _death(code: int | None) -> str:
    """Why a worker ended without its outcomes: its exit code or signal."""
    if code is not None and code < 0:
        how = f"killed by {signal.Signals(-code).name}"
    else:
        how = "exit code " + str(code)
    return f"a --jobs worker process stopped ({how}; out of memory?)"


class _StopPipe:
    """The stop event of a worker: set once the parent closed the stop pipe (or died)."""

    def __init__(self, pipe: Connection) -> None:
        self.pipe = pipe

    def is_set(self) -> bool:
        try:
            return self.pipe.poll()
        except (EOFError, OSError):
            return True


def _work(
    task: Task,
    compute: Any,
    chunk: list[tuple[int, Any]],
    events: Connection,
    stop: Connection,
    threads: int,
) -> None:
    """A worker: follow the stop pipe, then run the chunk's units, sending events."""
    import torch

    from gradstat.store import open_capture

    cancel.follow_event(_StopPipe(stop))
    threading.Thread(target=_end_on_stop, args=(stop,), daemon=True).start()
    torch.set_num_threads(threads)
    try:
        cap = open_capture(task.capture)
    except Exception as exc:  # the first unit's error, as in one process
        events.send((chunk[0][0], pickle.dumps(Outcome(error=exc).portable())))
        return
    with cap:
        for index, unit in chunk:

            def tick(index: int = index) -> None:
                cancel.check()
                events.send((index, None))

            outcome = run_unit(task, cap, compute, unit, tick).portable()
            events.send((index, pickle.dumps(outcome)))
            if outcome.error is not None:
                return


def _end_on_stop(stop: Connection) -> None:
    """End this worker as soon as its stop pipe is readable: closed by the parent, or
    the parent is gone (a worker never outlives the command, whatever ended it)."""
    wait([stop])
    os._exit(0)
