"""Row read paths side by side: another gradstat tree (e.g. the session's base) against
this one, and this one's direct reads (``os.preadv``) against plain HDF5 reads.

Writes one synthetic capture with each tree's own writer (the same values), then runs
each analysis in fresh processes, alternating the variants, and prints the median
time of each and the ratios:

* ``base``: the other tree (``--base``) on its capture;
* ``new``: this tree on its capture (checked reads, direct where the layout allows);
* ``new-plain``: this tree with the direct path switched off (every read through
  HDF5's ``read_direct``): whether the fast path pays (it stays only where it saves
  >= 20% end to end).

    python benchmarks/read_paths.py --base /work/wt/base --numel 8M --learners 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
SIZES = {"2M": 2 << 20, "8M": 8 << 20, "32M": 32 << 20}

WRITE = r"""
import sys
from pathlib import Path
import numpy as np
from gradstat.store import RankFileWriter, finalize_root, layer_table, write_root
folder = Path(sys.argv[1])
numel, learners, steps = (int(a) for a in sys.argv[2:5])
layers = layer_table([(f"layer{i}.weight", (numel // 8,)) for i in range(8)])
folder.mkdir(parents=True)
write_root(folder, layers, learners, "float32", {"workload": "synthetic"})
writers = [RankFileWriter(folder / f"rank-{r:05d}.h5", r, numel) for r in range(learners)]
for step in range(steps):
    rng = np.random.default_rng([0, step])
    shared = rng.standard_normal(numel, dtype=np.float32)
    for rank, writer in enumerate(writers):
        row = np.random.default_rng([0, step, rank + 1]).standard_normal(numel, dtype=np.float32)
        writer.append(step, 1.0, row + shared)
for writer in writers:
    writer.close()
finalize_root(folder)
"""

RUN = r"""
import json, sys, time
import numpy as np
path, what, plain = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
if plain:
    from gradstat.store import rows
    rows.DirectRows.usable = classmethod(lambda cls, *args: None)
from gradstat.store import open_capture
from gradstat.analysis.compute import Compute
from gradstat.analysis.selection import Selection
compute = Compute(device="cpu", jobs=1)
if what not in ("read", "fit"):
    from gradstat.stats.row_kernels import load
    load()
with open_capture(path) as cap:
    start = time.perf_counter()
    if what == "read":
        buffer = np.empty(cap.numel, dtype=np.float32)
        for step in cap.steps:
            for learner in cap.learners:
                cap.read_row(int(step), learner, out=buffer)
    elif what == "similarity":
        from gradstat.analysis.similarity import SimilarityParams, similarity
        similarity(cap, Selection.of(cap), SimilarityParams(0.001), compute=compute)
    elif what == "buildup":
        from gradstat.analysis.buildup import BuildupParams, buildup
        buildup(cap, Selection.of(cap), BuildupParams([0.001]), compute=compute)
    elif what == "fit":
        from gradstat.analysis.fit import FitParams, fit
        sel = Selection.of(cap, [int(s) for s in cap.steps], cap.learners[:1])
        fit(cap, sel, FitParams(dists="gpd"), compute=compute)
    elif what == "replay-topk":
        from gradstat.analysis.replay import ReplayParams, replay
        from gradstat.compressors.cost import Link
        replay(cap, Selection.of(cap), ReplayParams("topk", [0.001], Link(10e9 / 8, 5e-6)),
               compute=compute)
    print(json.dumps({"seconds": time.perf_counter() - start}))
"""


def warm(folder: Path) -> None:
    """Read every file of ``folder`` once, so that each variant starts from a warm page
    cache (else the variant that follows another on the same capture reads it warm)."""
    for file in folder.iterdir():
        with open(file, "rb") as f:
            while f.read(1 << 24):
                pass


def run(tree: Path, code: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(  # from "/": python -c puts the working directory first
        [sys.executable, "-c", code, *args],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        cwd="/",
    )
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the other gradstat tree")
    parser.add_argument("--new", type=Path, default=HERE, help="this tree (or a copy of it)")
    parser.add_argument("--numel", default="8M", choices=sorted(SIZES))
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--analyses", default="read,similarity,buildup,fit,replay-topk")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/gradstat-read-paths"))
    args = parser.parse_args()
    numel = SIZES[args.numel]
    shape = [str(numel), str(args.learners), str(args.steps)]
    folders = {"base": args.dir / "base", "new": args.dir / "new"}
    for name, folder in folders.items():
        if folder.exists():
            shutil.rmtree(folder)
        run(args.base if name == "base" else args.new, WRITE, str(folder), *shape)
    variants = [("base", args.base, "base", "0"), ("new", args.new, "new", "0")]
    variants.append(("new-plain", args.new, "new", "1"))
    print(
        f"{args.numel} x {args.learners} learners x {args.steps} steps, medians of "
        f"{args.repeats} fresh processes; load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'analysis':>12} {'base s':>8} {'new s':>8} {'plain s':>8} {'new/base':>9} "
        f"{'plain/new':>10}"
    )
    try:
        for what in args.analyses.split(","):
            times: dict[str, list[float]] = {v[0]: [] for v in variants}
            for _ in range(args.repeats):
                for name, tree, capture, plain in variants:
                    warm(folders[capture])
                    out = run(tree, RUN, str(folders[capture]), what, plain)
                    times[name].append(json.loads(out.strip().splitlines()[-1])["seconds"])
            base, new, plain = (statistics.median(times[v[0]]) for v in variants)
            print(
                f"{what:>12} {base:8.3f} {new:8.3f} {plain:8.3f} {new / base:9.2f} "
                f"{plain / new:10.2f}"
            )
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
