"""Collective emulation against the read floor, side by side in one process.

Writes a synthetic capture (``scale.py``'s ``write_synthetic``: a heavy-tailed shared
signal plus per-learner noise) of NUMEL values x N learners, one step, then for each
collective (``all_reduce`` and ``reduce_scatter`` of gradstat/compressors/
collectives.py), format, algorithm and accumulation times, alternately, ``--repeats``
times each and keeps the fastest of each:

* ``read``: the step's rows read from the capture into one (N, NUMEL) buffer
  (``Capture.read_row``, checked): the floor;
* the collective of those rows: the emulation time per step, and ``x read``, its ratio
  to the read measured beside it (on a busy machine the ratio holds where times do not);
* with ``--plain``, the same collective through the torch reference (``plain=True``,
  run once): ``gain``, its time over the compiled hops' time.

Target (issue 37): emulation / read <= 3 at 8M x 4 and 8M x 16 learners, ring and a2a.
The compiled loops load from numba's cache (the first run after a change compiles them,
before any timing).

    python benchmarks/lowprec.py --numel 8M --learners 4,16 --dir /tmp/lowprec
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from scale import write_synthetic

from gradstat import open_capture
from gradstat.wire.collectives import all_reduce, reduce_scatter

COLLECTIVES = {"all_reduce": all_reduce, "reduce_scatter": reduce_scatter}
SIZES = {"1M": 1 << 20, "8M": 1 << 23, "32M": 1 << 25}
#: The options whose comma-separated values the table crosses, in its order.
CHOICES = ("collectives", "formats", "algorithms", "accumulate")


def fastest(run: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", default="8M", choices=list(SIZES))
    parser.add_argument("--learners", default="4,16")
    parser.add_argument("--formats", default="bf16,fp8-e4m3,mxfp8,mxfp4")
    parser.add_argument("--algorithms", default="ring,a2a")
    parser.add_argument("--accumulate", default="fp32,wire")
    parser.add_argument("--collectives", default="all_reduce,reduce_scatter")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--plain", action="store_true", help="also time the torch reference (once each)"
    )
    parser.add_argument("--dir", type=Path, default=Path("/tmp/gradstat-lowprec"))
    return parser.parse_args()


def timed(rows: torch.Tensor, read: Callable[[], None], name: str, settings: dict, args) -> str:
    """One line of the table: a collective's seconds per step, over the read beside it."""
    collective = COLLECTIVES[name]
    collective(rows[:, :4096].contiguous(), **settings)  # load the compiled loops
    floor = seconds = float("inf")
    for _ in range(args.repeats):  # alternately: both see the same load
        floor = min(floor, fastest(read, 1))
        seconds = min(seconds, fastest(lambda: collective(rows, **settings), 1))
    what = f"{name} {settings['wire']} {settings['algorithm']} {settings['accumulate']}"
    line = f"{args.numel:>4} {len(rows):>3} {what:<34} {floor:6.3f} {seconds:8.3f} "
    line += f"{seconds / floor:7.2f}"
    if args.plain:
        plain = fastest(lambda: collective(rows, **settings, plain=True), 1)
        line += f" {plain / seconds:7.1f}"
    return line


def run_learners(args: argparse.Namespace, learners: int) -> None:
    numel = SIZES[args.numel]
    folder = args.dir / f"lowprec-{args.numel}-{learners}"
    if folder.exists():
        shutil.rmtree(folder)
    write_synthetic(folder, numel, learners, 1)
    try:
        with open_capture(folder) as cap:
            rows = torch.empty(learners, numel)

            def read() -> None:
                for i, learner in enumerate(cap.learners):
                    cap.read_row(0, learner, out=rows[i].numpy())

            read()
            for name, wire, algorithm, accumulate in itertools.product(
                *(getattr(args, key).split(",") for key in CHOICES)
            ):
                settings = {"wire": wire, "algorithm": algorithm, "accumulate": accumulate}
                print(timed(rows, read, name, settings, args), flush=True)
    finally:
        shutil.rmtree(folder)


def main() -> None:
    args = parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    header = f"{'size':>4} {'n':>3} {'what':<34} {'read':>6} {'s/step':>8} {'x read':>7}"
    if args.plain:
        header += f" {'gain':>7}"
    print(header)
    for learners in (int(n) for n in args.learners.split(",")):
        run_learners(args, learners)
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
