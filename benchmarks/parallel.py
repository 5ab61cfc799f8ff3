"""The default job policy against ``--jobs 1`` and ``--jobs 2``, as a table of ratios.

For each capture size (``--sizes`` numel per learner x ``--learners``), step count
(``--steps``: the first N steps of the capture), analysis (``--analyses``: similarity,
buildup and overlap at ratio 0.001, fit of learner 0 with ``gpd``, replay of top-k and
DGC at 0.001) and load (quiet, and beside one CPU-bound process: a Python busy loop),
runs the analysis with ``jobs=1``, ``jobs=2`` and the default (``jobs=None``), each in a
fresh process that times only the library call (its worker processes' start included),
alternating the three so that drift in the machine's load hits them alike. Prints each
time and ``default / best``: the default's time over the better of ``--jobs 1`` and
``--jobs 2``; the target (issue 28) is at most 1.1 on every row.

    python benchmarks/parallel.py --sizes 8M,32M --learners 4,16 --steps 2,10 \\
        --dir /work/tmp/parallel
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import SIZES, write_synthetic

RATIO = 0.001
MODES = {"--jobs 1": 1, "--jobs 2": 2, "default": None}

CHILD = r"""
import json, sys, time
from gradstat.analysis.compute import Compute
from gradstat.analysis.selection import Selection
from gradstat.store import open_capture
from gradstat.stats.row_kernels import load
from gradstat.analysis.similarity import SimilarityParams, similarity
from gradstat.analysis.buildup import BuildupParams, buildup
from gradstat.analysis.overlap import OverlapParams
try:  # an older tree (--base): the analysis was temporal_overlap (overlap a set metric)
    from gradstat.analysis.overlap import temporal_overlap as overlap
except ImportError:
    from gradstat.analysis.overlap import overlap
from gradstat.analysis.fit import FitParams, fit
from gradstat.analysis.replay import ReplayParams, replay
from gradstat.compressors.cost import Link

path, what, steps, jobs = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
load()  # numba's one-off start, as in every analysis process
compute = Compute(device="cpu", jobs=jobs)
with open_capture(path) as cap:
    chosen = [int(s) for s in cap.steps][:steps]
    selection = Selection.of(cap, chosen, cap.learners[:1] if what == "fit" else None)
    start = time.perf_counter()
    if what == "similarity":
        similarity(cap, selection, SimilarityParams(0.001), compute=compute)
    elif what == "buildup":
        buildup(cap, selection, BuildupParams([0.001]), compute=compute)
    elif what == "overlap":
        overlap(cap, selection, OverlapParams(0.001), compute=compute)
    elif what == "fit":
        fit(cap, selection, FitParams(dists="gpd"), compute=compute)
    elif what == "replay":
        params = ReplayParams("topk,dgc", [0.001], Link(10e9 / 8, 5e-6))
        replay(cap, selection, params, compute=compute)
    print(json.dumps({"seconds": time.perf_counter() - start}))
"""


def run_child(path: Path, what: str, steps: int, jobs: int | None) -> float:
    """Seconds of the library call in a fresh process."""
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), what, str(steps), json.dumps(jobs)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode:
        raise RuntimeError(f"{what} jobs={jobs} failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])["seconds"]


def measure(
    path: Path, what: str, steps: int, repeats: int, busy: bool, modes: dict
) -> dict[str, float]:
    """Median seconds of each mode, the modes alternating; ``busy``: beside a CPU hog."""
    spinner = None
    if busy:  # spins while its parent lives, also if the parent is killed
        spinner = subprocess.Popen(
            [sys.executable, "-c", f"import os\nwhile os.getppid() == {os.getpid()}: pass"]
        )
        time.sleep(0.5)
    try:
        runs: dict[str, list[float]] = {mode: [] for mode in modes}
        for _ in range(repeats):
            for mode, jobs in modes.items():
                runs[mode].append(run_child(path, what, steps, jobs))
        return {mode: statistics.median(times) for mode, times in runs.items()}
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8M,32M")
    parser.add_argument("--learners", default="4,16")
    parser.add_argument("--steps", default="2,10", help="step counts (comma-separated)")
    parser.add_argument("--analyses", default="similarity,buildup,overlap,fit,replay")
    parser.add_argument(
        "--max-gb", type=float, default=5.0, help="skip captures larger than this (GB)"
    )
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--same-default",
        action="store_true",
        help="do not run the default separately: it is Compute(jobs=None), the same code "
        "path as --jobs 1 (one process), so its column is the --jobs 1 time",
    )
    parser.add_argument("--dir", type=Path, default=Path("/work/tmp/parallel"))
    args = parser.parse_args()
    step_counts = sorted(int(s) for s in args.steps.split(","))
    modes = {m: j for m, j in MODES.items() if not (args.same_default and m == "default")}
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(
        f"{'numel':>5} {'n':>3} {'steps':>5} {'analysis':>10} {'load':>5} "
        f"{'jobs 1':>7} {'jobs 2':>7} {'default':>7} {'dflt/best':>9}",
        flush=True,
    )
    worst = 0.0
    for size in args.sizes.split(","):
        for learners in (int(n) for n in args.learners.split(",")):
            counts = [s for s in step_counts if SIZES[size] * 4 * learners * s / 1e9 <= args.max_gb]
            if not counts:
                print(f"{size:>5} {learners:>3} skipped: over --max-gb", flush=True)
                continue
            folder = args.dir / f"par-{size}-{learners}"
            shutil.rmtree(folder, ignore_errors=True)
            write_synthetic(folder, SIZES[size], learners, max(counts))
            try:
                for steps in counts:
                    for what in args.analyses.split(","):
                        for busy in (False, True):
                            t = measure(folder, what, steps, args.repeats, busy, modes)
                            t.setdefault("default", t["--jobs 1"])
                            ratio = t["default"] / min(t["--jobs 1"], t["--jobs 2"])
                            worst = max(worst, ratio)
                            print(
                                f"{size:>5} {learners:>3} {steps:>5} {what:>10} "
                                f"{'busy' if busy else 'quiet':>5} {t['--jobs 1']:7.2f} "
                                f"{t['--jobs 2']:7.2f} {t['default']:7.2f} {ratio:9.2f}",
                                flush=True,
                            )
            finally:
                shutil.rmtree(folder, ignore_errors=True)
    print(f"worst default / best: {worst:.2f} (target <= 1.1)")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
