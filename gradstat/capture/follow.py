"""Following one torchrun of a capture (gradstat/capture/launch.py starts it).

Its output lines go to the capture's log (:class:`CaptureLog`: a full disk stops the
log, not the capture; the last 200 lines are also kept, for a failure's reason); the
first learner's progress reports go to ``on_progress``; each new ``Warning:`` line goes
once to ``on_warning``; while the other nodes of a multi-node run
have not joined, a line every ``WAIT_REPORT_SECONDS`` goes to ``on_wait``, and the wait
ends in a ``DataError`` after the join timeout.
"""

from __future__ import annotations

import json
import queue
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from gradstat.capture.nodes import missing_text, waiting_text
from gradstat.capture.worker import PROGRESS_PREFIX
from gradstat.errors import DataError

if TYPE_CHECKING:  # launch.py imports this module
    from gradstat.capture.launch import CaptureOptions

#: Seconds between two "waiting for node ..." lines.
WAIT_REPORT_SECONDS = 10.0


class CaptureLog:
    """The capture's log file: a write that fails (a full or read-only disk) stops the
    logging, never the capture; :attr:`error` says why, for the capture's last line."""

    def __init__(self, file: TextIO) -> None:
        self.file = file
        self.error: OSError | None = None

    def write(self, text: str) -> None:
        if self.error is None:
            try:
                self.file.write(text)
            except OSError as exc:
                self.error = exc

    def flush(self) -> None:
        if self.error is None:
            try:
                self.file.flush()
            except OSError as exc:
                self.error = exc

    def close(self) -> None:
        self.flush()
        try:
            self.file.close()
        except OSError as exc:  # its last lines did not fit
            self.error = self.error or exc

    def note(self) -> str:
        """``""``, or why the log is cut short: ``; the log is cut short (...)``."""
        return "" if self.error is None else f"; the log is cut short ({self.error.strerror})"

    def __enter__(self) -> CaptureLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress_report(line: str) -> dict | None:
    """Rank 0's progress report, or None for any other line (kept in the log)."""
    if not line.startswith(PROGRESS_PREFIX):
        return None
    try:
        report = json.loads(line[len(PROGRESS_PREFIX) :])
    except json.JSONDecodeError:
        return None
    return report if isinstance(report, dict) else None


def stop(process: subprocess.Popen) -> None:
    """Stop torchrun (it stops its learners) and wait for it, at most 10 s politely."""
    if process.poll() is None:
        process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@dataclass
class Follower:
    """One torchrun ``process`` of a capture with ``options`` into ``run_dir``, writing
    to ``log``: ``options.join_timeout`` seconds for the other nodes to join."""

    process: subprocess.Popen
    log: CaptureLog
    run_dir: Path
    options: CaptureOptions
    on_progress: Callable[[dict], None] | None = None
    on_warning: Callable[[str], None] | None = None
    on_wait: Callable[[str], None] | None = None
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=200))
    _seen: set[str] = field(default_factory=set)

    def follow(self) -> int:
        """Every output line until torchrun ends; its exit code. Raises ``DataError``
        (torchrun stopped) when the other nodes do not join in time."""
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_forward, args=(self.process.stdout, lines), daemon=True).start()
        started, joined, next_report = time.monotonic(), self.options.nnodes == 1, 0.0
        while True:
            try:
                line = lines.get(timeout=1.0)
            except queue.Empty:
                if not joined:
                    next_report = self._waiting(time.monotonic() - started, next_report)
                continue
            if line is None:
                return self.process.wait()
            joined = self._line(line) or joined

    def _waiting(self, waited: float, next_report: float) -> float:
        """After ``waited`` seconds without the other nodes: the wait's line when it is
        due (the next time one is, returned), or the ``DataError`` at the time limit."""
        o = self.options
        if waited >= o.join_timeout:
            stop(self.process)
            rendezvous = f"{o.master_addr}:{o.master_port}"
            raise DataError(
                missing_text(self.run_dir, o.nnodes, o.node_rank, o.join_timeout, rendezvous)
            ) from None
        if waited >= next_report:
            next_report += WAIT_REPORT_SECONDS
            if self.on_wait is not None:
                self.on_wait(
                    waiting_text(self.run_dir, o.nnodes, o.node_rank, waited, o.join_timeout)
                )
        return next_report

    def _line(self, line: str) -> bool:
        """One output line: a progress report (True: every node has joined), else a log
        line, and a warning shown once."""
        report = progress_report(line)
        if report is not None:
            if self.on_progress is not None and "step" in report:
                self.on_progress(report)
            return True
        self.log.write(line)
        self.tail.append(line)
        if line.startswith("Warning:") and self.on_warning is not None:
            message = line[len("Warning:") :].strip()
            if message not in self._seen:
                self._seen.add(message)
                self.on_warning(message)
        return False


def _forward(stream, lines: queue.Queue) -> None:
    """Move torchrun's output lines to a queue, so the follower can also watch the clock."""
    for line in stream:
        lines.put(line)
    lines.put(None)
