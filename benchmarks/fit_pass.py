"""``fit`` per row against a plain h5py read of the row, side by side in one run.

Writes a one-learner capture of ``--steps`` rows of ``--numel`` values (default: a
ResNet-50 row, 23.5M; the values a normal scaled by a log-normal factor, heavy-tailed like
gradients, with 1 in 1000 exact zeros), then in a fresh process per checkout
(``--before PATH`` adds another, ``PYTHONPATH=PATH``) times:

* ``read``: rows 1.. read by plain h5py (``read_direct`` into one buffer): the floor;
* ``fit``: ``fit --dist gpd`` with the default estimators and ratios, ``--jobs 1``, of the
  same rows, after a fit of row 0 (numba's start, the imports).

Prints seconds per row and fit / read. Issue 28's goal: fit <= 3x the read.

    flock /work/bench.lock python benchmarks/fit_pass.py --before /work/wt/base
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, time
import h5py, numpy as np
from gradstat.analysis.compute import Compute
from gradstat.analysis.fit import FitParams, fit
from gradstat.analysis.selection import Selection
from gradstat.store import open_capture

path = sys.argv[1]
with open_capture(path) as cap:
    steps = cap.steps
    compute = Compute(device="cpu", jobs=1)
    fit(cap, Selection.of(cap, steps[:1]), FitParams(dists="gpd"), compute=compute)
    start = time.perf_counter()
    fit(cap, Selection.of(cap, steps[1:]), FitParams(dists="gpd"), compute=compute)
    fit_s = (time.perf_counter() - start) / (len(steps) - 1)
with h5py.File(f"{path}/rank-00000.h5", "r") as f:
    grad = f["grad"]
    row = np.empty(grad.shape[1], np.float32)
    grad.read_direct(row, np.s_[0])
    start = time.perf_counter()
    for i in range(1, len(steps)):
        grad.read_direct(row, np.s_[i])
    read_s = (time.perf_counter() - start) / (len(steps) - 1)
print(json.dumps({"fit": fit_s, "read": read_s}))
"""


def _write(path: Path, numel: int, steps: int) -> None:
    from gradstat.store import layer_table, write_capture

    rng = np.random.default_rng(0)
    grads = np.empty((1, steps, numel), np.float32)
    for s in range(steps):
        row = rng.standard_normal(numel, dtype=np.float32)
        row *= np.exp(rng.standard_normal(numel, dtype=np.float32))
        row *= np.float32(1e-3)
        row[rng.integers(0, numel, numel // 1000)] = 0.0
        grads[0, s] = row
    write_capture(path, grads, layer_table([("weight", (numel,))]))


def _run(tree: Path, capture: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(capture)], env=env, capture_output=True, text=True
    )
    if out.returncode:
        raise SystemExit(f"{tree}: {out.stderr.strip().splitlines()[-1]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=23_520_842)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--before", type=Path, help="another checkout, timed alongside")
    parser.add_argument("--dir", type=Path, default=None, help="where the capture goes")
    args = parser.parse_args()
    trees = {"now": HERE} | ({"before": args.before.resolve()} if args.before else {})
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        capture = Path(tmp) / "cap"
        _write(capture, args.numel, args.steps)
        results = {name: _run(tree, capture) for name, tree in trees.items()}
    load = os.getloadavg()[0]
    print(f"fit --dist gpd per row of {args.numel:,} values, --jobs 1; load {load:.1f}")
    print(f"{'tree':<8}{'fit s':>8}{'read s':>8}{'fit/read':>10}")
    for name, r in results.items():
        print(f"{name:<8}{r['fit']:8.3f}{r['read']:8.3f}{r['fit'] / r['read']:10.1f}")


if __name__ == "__main__":
    main()
