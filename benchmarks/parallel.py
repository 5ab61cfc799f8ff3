"""The thread policy, ``--jobs`` and the streamed replay, as ratios measured side by side.

On a synthetic capture (a shared Laplace signal plus each learner's own, ``--learners`` x
``--numel`` x ``--steps``, default 4 x 4M x 4: 64 MiB a step):

1. Threads: for single torch ops on vectors of 2^17..2^23 values (``|g|`` then
   ``torch.topk`` at density 0.001; a float64 sum), the time on 2 intra-op threads over
   the time on 1, on the quiet machine and with one CPU-bound process beside it (a
   Python busy loop). Above 1: threads hurt.
2. Busy machine: ``similarity`` at ratio 0.001 in this process, time with the busy
   process beside it over the quiet time, under the policy (1 thread, ``--jobs 1`` and
   the default ``--jobs``) and, for comparison, torch's former default of 2 threads.
   Target (issue 9): at most 1.3.
3. ``--jobs``: time with ``--jobs 1`` over ``--jobs 2`` for fit (GPD, default
   estimators), similarity, build-up, overlap and replay (5 configurations).
4. Replay over read: for each compressor at ratio 0.001, the time of a replay of the
   steps (one configuration, one process, memories in RAM) over the time of reading the
   same rows the way the replay does (one learner's row at a time). Target: at most 2.

Each timing is the median of ``--repeats`` (default 3), alternating the configurations
compared so that drift in the shared machine's load hits them alike.

Run: ``.venv/bin/python benchmarks/parallel.py [--numel 4194304] [--learners 4] [--steps 4]``
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from gradstat.analysis.buildup import BuildupParams, buildup
from gradstat.analysis.compute import Compute
from gradstat.analysis.fit import FitParams, fit
from gradstat.analysis.overlap import OverlapParams, temporal_overlap
from gradstat.analysis.replay import Replay, ReplayParams
from gradstat.analysis.selection import Selection
from gradstat.analysis.similarity import SimilarityParams, similarity
from gradstat.compressors import parse_link
from gradstat.parallel.threads import THREADS_ENV, default_jobs, torch_threads
from gradstat.store import layer_table, open_capture, write_capture

LINK = parse_link("10Gbit/s", "5us")
REPLAYED = "topk,randomk,dgc,sidco-gpd,gaussiank,clt-k,gtopk,powersgd,fp16,qsgd,ef-signsgd"


def write(path: Path, learners: int, numel: int, steps: int) -> Path:
    """A capture of ``learners x steps`` rows, written one learner at a time."""
    rng = np.random.default_rng(0)
    side = int(np.sqrt(numel // 8))
    shapes = [(side, side)] * 8
    rest = numel - 8 * side * side
    layers = layer_table([(f"w{i}", s) for i, s in enumerate(shapes)] + [("b", (rest,))])
    shared = rng.laplace(size=(1, steps, numel)).astype(np.float32)
    grads = np.empty((learners, steps, numel), dtype=np.float32)
    for i in range(learners):
        grads[i] = shared[0] + 0.5 * rng.laplace(size=(steps, numel)).astype(np.float32)
    return write_capture(path, grads, layers)


@contextmanager
def busy():
    """One CPU-bound process beside the measurement."""
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    time.sleep(0.5)
    try:
        yield
    finally:
        loop.kill()
        loop.wait()


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def medians(configs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each configuration, run alternately after one warm-up each."""
    for fn in configs.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(repeats):
        for name, fn in configs.items():
            times[name].append(timed(fn))
    return {name: statistics.median(t) for name, t in times.items()}


def thread_ops(repeats: int) -> None:
    print("1. time on 2 intra-op threads / on 1 (above 1: threads hurt)")
    print(f"   {'values':>10} {'op':<12} {'quiet':>7} {'busy':>7}")
    for size in (1 << 17, 1 << 20, 1 << 23):
        x = torch.randn(size)
        k = max(1, size // 1000)
        ops = {
            "|g|+topk": lambda x=x, k=k: torch.topk(x.abs(), k, sorted=False),
            "sum fp64": lambda x=x: x.double().sum(),
        }
        for name, op in ops.items():
            ratios = []
            for loaded in (False, True):
                with busy() if loaded else _nothing():

                    def on(count: int, op=op) -> Callable[[], object]:
                        def run() -> None:
                            with torch_threads(count):
                                for _ in range(5):
                                    op()

                        return run

                    t = medians({"1": on(1), "2": on(2)}, repeats)
                ratios.append(t["2"] / t["1"])
            print(f"   {size:>10,} {name:<12} {ratios[0]:>7.2f} {ratios[1]:>7.2f}")


@contextmanager
def _nothing():
    yield


def busy_machine(cap, repeats: int) -> None:
    import os

    print("2. similarity --ratio 0.001: time with a busy process beside it / quiet")
    selection, params = Selection.of(cap), SimilarityParams(ratio=0.001)
    configs = {
        "policy, --jobs 1": ("1", 1),
        f"policy, --jobs {default_jobs()} (default)": ("1", default_jobs()),
        "2 torch threads, --jobs 1 (before)": ("2", 1),
    }
    print(f"   {'configuration':<36} {'quiet s':>8} {'busy s':>8} {'busy/quiet':>10}")
    for name, (count, jobs) in configs.items():

        def run(jobs=jobs) -> None:
            similarity(cap, selection, params, compute=Compute(device="cpu", jobs=jobs))

        os.environ[THREADS_ENV] = count
        try:
            quiet = medians({"q": run}, repeats)["q"]
            with busy():
                loaded = medians({"b": run}, repeats)["b"]
        finally:
            del os.environ[THREADS_ENV]
        print(f"   {name:<36} {quiet:>8.2f} {loaded:>8.2f} {loaded / quiet:>10.2f}")


def jobs_speedup(cap, repeats: int) -> None:
    print("3. time with --jobs 1 / with --jobs 2")
    selection = Selection.of(cap)
    analyses = {
        "fit --dist gpd": lambda c: fit(cap, selection, FitParams(ratios=(0.001,)), compute=c),
        "similarity": lambda c: similarity(cap, selection, SimilarityParams(), compute=c),
        "buildup": lambda c: buildup(cap, selection, BuildupParams(), compute=c),
        "overlap": lambda c: temporal_overlap(cap, selection, OverlapParams(), compute=c),
        "replay (5 configurations)": lambda c: Replay(
            cap,
            selection,
            ReplayParams("topk,dgc,sidco-gpd,clt-k,powersgd", (0.001,), LINK),
            compute=c,
        ).run(),
    }
    print(f"   {'analysis':<28} {'jobs 1 s':>9} {'jobs 2 s':>9} {'speed-up':>9}")
    for name, run in analyses.items():
        t = medians(
            {
                "1": lambda run=run: run(Compute(device="cpu", jobs=1)),
                "2": lambda run=run: run(Compute(device="cpu", jobs=2)),
            },
            repeats,
        )
        print(f"   {name:<28} {t['1']:>9.2f} {t['2']:>9.2f} {t['1'] / t['2']:>9.2f}")


def replay_over_read(cap, repeats: int) -> None:
    print("4. replay of one configuration at ratio 0.001 / reading the same rows")
    selection = Selection.of(cap)

    def read() -> None:
        for step in selection.steps:
            for learner in selection.learners:
                cap.read_step(step, [learner])

    print(f"   {'compressor':<12} {'replay s':>9} {'read s':>8} {'replay/read':>12}")
    for name in REPLAYED.split(","):
        params = ReplayParams(name, (0.001,), LINK)

        def run(params=params) -> None:
            Replay(cap, selection, params, compute=Compute(device="cpu", jobs=1)).run()

        t = medians({"replay": run, "read": read}, repeats)
        print(
            f"   {name:<12} {t['replay']:>9.2f} {t['read']:>8.2f} {t['replay'] / t['read']:>12.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=1 << 22)
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default="1234", help="sections to run, e.g. 24")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = write(Path(tmp) / "cap", args.learners, args.numel, args.steps)
        print(f"capture: {args.learners} learners x {args.numel:,} values x {args.steps} steps")
        with open_capture(path) as cap:
            sections = {
                "1": lambda: thread_ops(args.repeats),
                "2": lambda: busy_machine(cap, args.repeats),
                "3": lambda: jobs_speedup(cap, args.repeats),
                "4": lambda: replay_over_read(cap, args.repeats),
            }
            for key in args.only:
                sections[key]()


if __name__ == "__main__":
    main()
