"""``fit`` per row against a plain h5py read of the row, side by side in one run.

Writes a one-learner capture of ``--steps`` rows of ``--numel`` values (default: a
ResNet-50 row, 23.5M; the values a normal scaled by a log-normal factor, heavy-tailed like
gradients, with 1 in 1000 exact zeros), then in a fresh process per checkout
(``--before PATH`` adds another, ``PYTHONPATH=PATH``) times:

* ``read``: rows 1.. read by plain h5py (``read_direct`` into one buffer): the floor;
* ``fit``: ``fit --dist gpd`` with the default estimators and ratios, ``--jobs 1``, of the
  same rows, after a fit of row 0 (numba's start, the imports);
* ``bins`` and ``gather``: the two passes over the row a fit makes, alone: the bins
  (``bin_sums_compiled``) and a gather of every 60th occupied bin (``gather_compiled``,
  about 1% of the values), fastest of the rows: the floor under the fit's own logic.

Runs the trees in turn ``--repeats`` times and keeps each one's fastest run (this
machine is shared: one run's figures can be 1.5x another's). Prints seconds per row and
fit / read. Issue 28's goal: fit <= 3x the read.

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
#: What each run times (see the module), the read first.
KEYS = ("read", "fit", "bins", "gather")

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
from gradstat.stats.histogram import bin_sums_compiled, gather_compiled
bins_s, gather_s = [], []
with h5py.File(f"{path}/rank-00000.h5", "r") as f:
    for i in range(1, len(steps)):
        f["grad"].read_direct(row, np.s_[i])
        start = time.perf_counter()
        counts = bin_sums_compiled(row).counts
        bins_s.append(time.perf_counter() - start)
        chosen = np.flatnonzero(counts)[::60]
        start = time.perf_counter()
        gather_compiled(row, chosen, counts)
        gather_s.append(time.perf_counter() - start)
print(json.dumps({"fit": fit_s, "read": read_s, "bins": min(bins_s), "gather": min(gather_s)}))
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
    out = subprocess.run(  # not in a checkout: ``-c`` puts the folder first on the path
        [sys.executable, "-c", CHILD, str(capture)],
        env=env,
        capture_output=True,
        text=True,
        cwd=tempfile.gettempdir(),
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
    parser.add_argument("--repeats", type=int, default=3, help="runs of each tree, in turn")
    args = parser.parse_args()
    trees = {"now": HERE} | ({"before": args.before.resolve()} if args.before else {})
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        capture = Path(tmp) / "cap"
        _write(capture, args.numel, args.steps)
        runs = [
            {name: _run(tree, capture) for name, tree in trees.items()} for _ in range(args.repeats)
        ]
        results = {
            name: {key: min(run[name][key] for run in runs) for key in KEYS} for name in trees
        }
    load = os.getloadavg()[0]
    print(f"fit --dist gpd per row of {args.numel:,} values, --jobs 1; load {load:.1f}")
    print(f"fastest of {args.repeats} runs each, in turn")
    print(f"{'tree':<8}{'read s':>8}" + "".join(f"{key + ' s':>9}{'/read':>6}" for key in KEYS[1:]))
    for name, r in results.items():
        ratios = "".join(f"{r[key]:9.3f}{r[key] / r['read']:6.1f}" for key in KEYS[1:])
        print(f"{name:<8}{r['read']:8.3f}{ratios}")


if __name__ == "__main__":
    main()
