"""Run units in ``--jobs`` worker processes (:mod:`gradstat.parallel.worker`).

Workers are fresh interpreters (no fork of a process that holds open HDF5 files or
torch's thread pools), each on its own share of the CPUs (:mod:`~gradstat.parallel.threads`).
Each worker gets a contiguous run of the units (:func:`contiguous`), so that units
sharing data (overlap's consecutive step pairs) meet in one process, and holds two at a
time so that it never waits for its next one; outcomes come back as JSON lines and are
put back in unit order by the caller.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import selectors
import subprocess
import sys
import tempfile
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

from gradstat.errors import GradstatError
from gradstat.parallel.codec import decode, encode
from gradstat.parallel.threads import worker_environment

#: Units a worker holds at once: one running, one waiting.
IN_FLIGHT = 2


class WorkerDied(GradstatError):
    """A worker process stopped without answering (killed, out of memory)."""


class _Worker:
    def __init__(self, header: bytes, threads: int) -> None:
        self.log: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gradstat.parallel.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=worker_environment(threads),
        )
        self.pending = 0
        self.queue: deque[tuple[int, Any]] = deque()
        self.partial = bytearray()  # the start of an answer line still arriving
        self.send(header)

    def answers(self) -> list[bytes]:
        """The complete answer lines that have arrived, after one read of what is there.

        Reads the pipe's file descriptor directly: a buffered ``readline`` would pull two
        quick answers into Python's buffer and return one, and ``select`` would never
        report the other (the pipe is empty), so the pool would wait for it forever
        (it did, on ``overlap --jobs 2``)."""
        assert self.process.stdout is not None
        chunk = os.read(self.process.stdout.fileno(), 1 << 20)
        if not chunk:
            raise self.died()
        self.partial += chunk
        *lines, rest = self.partial.split(b"\n")
        self.partial = bytearray(rest)
        return lines

    def send(self, line: bytes) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + b"\n")
        self.process.stdin.flush()

    def died(self) -> WorkerDied:
        code = self.process.wait()
        self.log.seek(0)
        lines = [line for line in self.log.read().decode(errors="replace").splitlines() if line]
        reason = f": {lines[-1]}" if lines else ""
        return WorkerDied(f"a --jobs worker process stopped (exit code {code}){reason}")

    def stop(self) -> None:
        if self.process.stdin is not None and not self.process.stdin.closed:
            with contextlib.suppress(OSError):  # a dead worker's pipe
                self.process.stdin.close()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        self.log.close()


def run_pool(
    task: dict,
    units: Sequence[Any],
    jobs: int,
    threads: int = 1,
    on_tick: Callable[[int], None] | None = None,
) -> Iterator[tuple[int, dict]]:
    """Yield ``(index, outcome)`` of every unit (typed JSON) as ``jobs`` workers running
    ``task`` (a task message) finish them, in any order. ``on_tick(index)``: a unit
    reported a part of its work done (a worker's tick line)."""
    header = encode({"task": task, "threads": threads})
    workers: list[_Worker] = []
    selector = selectors.DefaultSelector()
    try:
        for start, stop in contiguous(len(units), min(jobs, len(units))):
            worker = _Worker(header, threads)
            workers.append(worker)
            worker.queue.extend((i, units[i]) for i in range(start, stop))
            assert worker.process.stdout is not None
            selector.register(worker.process.stdout, selectors.EVENT_READ, worker)
        for worker in workers:
            _feed(worker)
        remaining = len(units)
        while remaining:
            for key, _ in selector.select():
                worker = key.data
                for line in worker.answers():
                    answer = decode(line)
                    if answer.get("tick"):
                        if on_tick is not None:
                            on_tick(answer["index"])
                        continue
                    worker.pending -= 1
                    remaining -= 1
                    _feed(worker)
                    index = answer.pop("index")
                    yield index, answer
    finally:
        selector.close()
        for worker in workers:
            worker.stop()


def contiguous(count: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``(start, stop)`` runs of ``range(count)``, sizes within one."""
    bounds = [count * part // parts for part in range(parts + 1)]
    return list(itertools.pairwise(bounds))


def _feed(worker: _Worker) -> None:
    while worker.queue and worker.pending < IN_FLIGHT:
        index, unit = worker.queue.popleft()
        worker.send(encode({"index": index, "unit": unit}))
        worker.pending += 1
