"""A ``--jobs`` worker process: ``python -m gradstat.parallel.worker``.

Protocol (one JSON document per line, :mod:`gradstat.parallel.codec`): the parent
writes a header ``{"task": ..., "threads": N}`` (a :class:`~gradstat.parallel.units.Task`
message), then units ``{"index": i, "unit": ...}``; the worker answers each with
``{"index": i, ...outcome}`` (``Task.run``), after a line ``{"index": i, "tick": true}``
for each part of the unit done (:func:`~gradstat.parallel.units.unit_progress`), and
exits when its input closes. Answers go
to the original stdout, which is kept for them alone: anything else the worker prints
lands on its stderr. SIGINT is ignored (the parent stops its workers), and the worker
dies with its parent.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        parent = os.getppid()
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(1)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    import torch

    from gradstat.parallel.allocator import tune_allocators
    from gradstat.parallel.codec import decode, encode, from_typed
    from gradstat.parallel.units import Task

    tune_allocators()

    requests = sys.stdin.buffer
    header = decode(requests.readline())
    torch.set_num_threads(int(header["threads"]))
    task = Task.from_message(header["task"])

    def answer(document: dict) -> None:
        answers.write(encode(document) + b"\n")
        answers.flush()

    try:
        for line in requests:
            message = decode(line)
            index = message["index"]
            tick = {"index": index, "tick": True}
            outcome = task.run(from_typed(message["unit"]), tick=lambda tick=tick: answer(tick))
            answer({"index": index, **outcome})
    finally:
        task.close()


if __name__ == "__main__":
    main()
