"""Analyses at scale: time against the read floor and peak memory, side by side in one run.

Writes synthetic schema-1 captures row by row (a heavy-tailed shared signal, normal
scaled by a log-normal factor, plus per-learner normal noise; 8 equal layers; one step's
shared signal and one row in memory at a time, through gradstat's ``RankFileWriter``),
for each numel per learner and learner count, then runs in a fresh subprocess each:

* ``read``: every selected row once (``Capture.read_row`` into one buffer): the floor;
* ``similarity`` (ratio 0.001), ``buildup`` (0.001) and ``overlap`` (0.001, lag 1) over
  every step and learner;
* ``noise`` (batch size 32) and ``consistency`` over every step and learner: one pass
  over the rows each (the learners' Gram matrix per step; target <= 1.5x the read);
* ``fit`` (``gpd``, the default estimators and ratios) of learner 0 at every step,
  against the read of those rows (time per row);
* ``replay-topk`` and ``replay-dgc``: a replay of that compressor at ratio 0.001 with
  error feedback over every step and learner, at the capture's granularity (``model``:
  the synthetic captures record no DDP); ``--analyses`` names others, e.g.
  ``replay-sidco-gpd``, or another granularity, ``replay-topk@bucket`` (DDP's buckets of
  the 8 equal layers);
* ``touch``: the first touch of learners x numel float32 values (a replay's error-feedback
  memories) in a fresh process, the other floor a replay cannot go under: on this
  virtual machine the host hands memory a process frees back to itself within seconds
  (the balloon's free page reporting), and a fresh process's pages cost host faults,
  about 1.8 s a GB (docs/large.md). Replay rows also print time / (read + touch).

``--plain NAME,...`` also times each analysis without each named fast path (one at a
time, :data:`PLAIN`: the compiled row loops by their numpy twins, the replay's reading
thread, RowPasses' kept sets and the top-k pre-filter), the audit of
docs/large.md ("Fast paths"). ``--base TREE`` runs each analysis from another source
tree too, on a capture its own writer made. Each tree (and each fast path left out)
first runs every analysis once on a small capture, untimed, so that no timed run pays
numba's compile.

``--repeats N`` runs each N times in fresh processes (median time, largest RSS); ``--busy``
runs each analysis again while another CPU-bound process (a Python busy loop) runs, and
prints busy / quiet.

Each analysis runs as a library call in one process (``Compute(device="cpu", jobs=1)``,
the default thread policy) and reports its own wall time without the interpreter start,
the imports and numba's one-off start (about 0.7 s a process), and its own peak RSS
(``VmHWM``, read by the child at its end; ``wait4``'s ``ru_maxrss`` would also count the
parent's peak, which a child started with ``vfork`` inherits until its ``exec``: 2.5 GB
after writing a 128M capture). Also prints a raw
read of one row's bytes (``os.preadv`` of its chunks) over gradstat's checked read of
that row (``raw/h5py``, target >= 0.7). Targets (issue 9): similarity / buildup /
overlap <= 2x the read, fit <= 4x, peak RSS <= 600 MB + 3 x numel x 4 + 16 x learners x
k bytes (replay: plus the error-feedback memories, learners x numel x 4); busy <= 1.3x
quiet.

    python benchmarks/scale.py --sizes 8M,32M --learners 4,16 --dir /work/tmp-scale
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from gradstat.store import RankFileWriter, finalize_root, layer_table, write_root

SIZES = {"8M": 8 << 20, "32M": 32 << 20, "128M": 128 << 20}
#: This checkout: what the children import when no other tree is named.
ROOT = str(Path(__file__).resolve().parent.parent)
RATIO = 0.001
LAYERS = 8

#: ``--plain NAME``: what the child runs instead of each fast path (docs/large.md, "Fast
#: paths"), swapped in before the analysis starts.
PLAIN = {
    # every compiled row loop (gradstat.stats.row_kernels) by its numpy twin (row_plain)
    "loops": """
import gradstat.stats.row_kernels as fast, gradstat.stats.row_plain as slow
for name in [n for n in vars(slow) if not n.startswith("_") and callable(getattr(fast, n, 0))]:
    if getattr(fast, name) is not getattr(slow, name) and callable(getattr(slow, name)):
        swap(getattr(fast, name), getattr(slow, name))
""",
    # no reading thread (the replay's): each row read when it is asked for, in one buffer
    "ahead": """
import gradstat.analysis.row_workspace as rw
def rows(self, cap, step, learners, scope, start, stop, then=None, after=None):
    for learner in learners:
        row = rw.read_block(cap, step, learner, scope, start, stop, self.buffers[0])
        yield row if after is None else (row, after(row))
rw.Workspace.rows = rows
""",
    # RowPasses keeps no exceedance sets: each count and filter scans the first pool
    "pools": """
import gradstat.stats.passes as passes
passes.RowPasses._keep = lambda self, threshold, inclusive, found: None
""",
    # top-k of every row by torch.topk of all of it, no sampled pre-filter
    "prefilter": """
import gradstat.stats.topk_sets as topk_sets
swap(topk_sets.prefilter_threshold, lambda row, k, sample=None: None)
""",
}

CHILD = r"""
import json, sys, time
import numpy as np
from gradstat.store import open_capture
from gradstat.analysis.compute import Compute
from gradstat.analysis.selection import Selection
from gradstat.analysis.similarity import SimilarityParams, similarity
from gradstat.analysis.buildup import BuildupParams, buildup
from gradstat.analysis.overlap import OverlapParams
try:  # an older tree (--base): the analysis was temporal_overlap (overlap a set metric)
    from gradstat.analysis.overlap import temporal_overlap as overlap
except ImportError:
    from gradstat.analysis.overlap import overlap
from gradstat.analysis.fit import FitParams, fit
from gradstat.analysis.replay import ReplayParams, replay
try:  # imported before the clock starts, as every analysis above; a --base tree may lack them
    from gradstat.analysis.noise import NoiseParams, noise
    from gradstat.analysis.consistency import consistency
except ImportError:
    pass
from gradstat.compressors.cost import Link
from gradstat.stats.row_kernels import load as load_row_loops

try:  # an older tree (--base) tuned its allocators in every analysis process
    from gradstat.parallel.allocator import tune_allocators
except ImportError:
    pass
else:
    tune_allocators()

path, what, ratio = sys.argv[1], sys.argv[2], float(sys.argv[3])


def swap(fast, plain):  # the function fast replaced by plain wherever gradstat names it
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("gradstat"):
            for name, value in list(vars(module).items()):
                if value is fast:
                    setattr(module, name, plain)


for plain in filter(None, sys.argv[4].split(",")):  # --plain: fast paths left out
    exec(PLAIN[plain])
if what == "touch":  # a replay's error-feedback memories: first touch in a fresh process
    with open_capture(path) as cap:
        size = len(cap.learners) * cap.numel
    start = time.perf_counter()
    memories = np.empty(size, dtype=np.float32)
    memories.fill(0.0)
    print(json.dumps({"seconds": time.perf_counter() - start, "peak_rss": 0}))
    sys.exit(0)
if what not in ("read", "read-one", "fit", "noise", "consistency"):  # never load numba
    load_row_loops()  # numba's one-off start (~0.7 s a process), like the imports
compute = Compute(device="cpu", jobs=1)
with open_capture(path) as cap:
    steps = [int(s) for s in cap.steps]
    start, cpu = time.perf_counter(), time.process_time()
    if what in ("read", "read-one"):
        buffer = np.empty(cap.numel, dtype=np.float32)
        learners = cap.learners if what == "read" else cap.learners[:1]
        for step in steps:
            for learner in learners:
                cap.read_row(step, learner, out=buffer)
    elif what == "similarity":
        similarity(cap, Selection.of(cap), SimilarityParams(ratio), compute=compute)
    elif what == "buildup":
        buildup(cap, Selection.of(cap), BuildupParams([ratio]), compute=compute)
    elif what == "overlap":
        overlap(cap, Selection.of(cap), OverlapParams(ratio), compute=compute)
    elif what == "noise":
        noise(cap, Selection.of(cap), NoiseParams(batch_size=32), compute=compute)
    elif what == "consistency":
        consistency(cap, Selection.of(cap), compute=compute)
    elif what == "fit":
        selection = Selection.of(cap, steps, cap.learners[:1])
        fit(cap, selection, FitParams(dists="gpd"), compute=compute)
    elif what.startswith("replay-"):  # one compressor with error feedback, every step
        name, _, granularity = what.removeprefix("replay-").partition("@")
        plan = {"granularity": granularity} if granularity else {}  # a base tree has none
        params = ReplayParams(name, [ratio], Link(10e9 / 8, 5e-6), **plan)
        replay(cap, Selection.of(cap), params, compute=compute)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
with open("/proc/self/status") as status:  # this process's own peak (see run_child)
    peak = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
print(json.dumps({"seconds": seconds, "cpu": cpu, "peak_rss": peak}))
"""


def write_synthetic(
    folder: Path, numel: int, learners: int, steps: int, seed: int = 0, layers=None
) -> None:
    """A schema-1 capture written row by row: shared heavy-tailed signal + learner noise;
    ``layers``: its layer table (default :data:`LAYERS` equal vectors)."""
    if layers is None:
        layers = layer_table([(f"layer{i}.weight", (numel // LAYERS,)) for i in range(LAYERS)])
    folder.mkdir(parents=True)
    write_root(folder, layers, learners, "float32", {"workload": "synthetic-scale"})
    writers = [RankFileWriter(folder / f"rank-{r:05d}.h5", r, numel) for r in range(learners)]
    row = np.empty(numel, dtype=np.float32)
    for step in range(steps):
        rng = np.random.default_rng([seed, step])
        shared = rng.standard_normal(numel, dtype=np.float32)
        shared *= np.exp(0.7 * rng.standard_normal(numel, dtype=np.float32))
        for rank, writer in enumerate(writers):
            noise = np.random.default_rng([seed, step, rank + 1])
            noise.standard_normal(numel, dtype=np.float32, out=row)
            row += shared
            writer.append(step, 1.0, row)
        del shared
    for writer in writers:
        writer.close()
    finalize_root(folder)


def median_run(
    path: Path,
    what: str,
    repeats: int,
    busy: bool = False,
    tree: str | None = None,
    plain: str = "",
) -> tuple[float, float]:
    """Median seconds and largest peak RSS of ``repeats`` fresh runs (``tree``: the
    source tree on the child's ``PYTHONPATH``, None: this one; ``plain``: the fast
    paths of :data:`PLAIN` it runs without, comma-separated)."""
    runs = [run_child(path, what, busy, tree, plain) for _ in range(repeats)]
    return statistics.median(r[0] for r in runs), max(r[1] for r in runs)


def run_child(
    path: Path, what: str, busy: bool = False, tree: str | None = None, plain: str = ""
) -> tuple[float, float]:
    """(seconds inside the child, the child's own peak RSS in bytes); ``busy``: while a
    CPU-bound process competes for the cores."""
    if busy:
        spinner = subprocess.Popen(  # spins while its parent lives, also if it is killed
            [sys.executable, "-c", f"import os\nwhile os.getppid() == {os.getpid()}: pass"]
        )
        try:
            time.sleep(0.5)  # let it take its core
            return run_child(path, what, tree=tree, plain=plain)
        finally:
            spinner.kill()
            spinner.wait()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        env = {**os.environ, "PYTHONPATH": tree or ROOT}
        code = f"PLAIN = {PLAIN!r}\n{CHILD}"
        child = subprocess.Popen(  # not in a checkout: ``-c`` puts the folder first on the path
            [sys.executable, "-c", code, str(path), what, str(RATIO), plain],
            stdout=out,
            stderr=err,
            env=env,
            cwd=tempfile.gettempdir(),
        )
        child.wait()
        out.seek(0)
        err.seek(0)
        if child.returncode:
            raise RuntimeError(f"{what} failed:\n{err.read()}")
        report = json.loads(out.read().strip().splitlines()[-1])
    return report["seconds"], report["peak_rss"]


def raw_vs_h5py(path: Path, numel: int) -> float:
    """A raw read of one row's bytes (``os.preadv`` of each of its chunks, located by
    HDF5) over gradstat's checked read of that row (``Capture.read_row``: the read and
    the CRC-32C check); best of 5, both warm, into the same kind of buffer."""
    import h5py

    from gradstat.store import open_capture

    buffer = np.empty(numel, dtype=np.float32)
    raw = np.empty(numel, dtype=np.float32)
    target = memoryview(raw).cast("B")
    best_h5 = best_raw = float("inf")
    rank_file = path / "rank-00000.h5"
    with open_capture(path) as cap, h5py.File(rank_file, "r") as f:
        step = int(cap.steps[-1])
        row = int(np.flatnonzero(f["step"][:] == step)[0])
        grad, width = f["grad"], f["grad"].chunks[1]
        pieces = []  # (file offset, first byte, end byte) of each chunk of the row
        for column in range(0, numel, width):
            offset = grad.id.get_chunk_info_by_coord((row, column)).byte_offset
            pieces.append((offset, column * 4, min(numel, column + width) * 4))
        fd = os.open(rank_file, os.O_RDONLY)
        try:
            for _ in range(5):
                start = time.perf_counter()
                cap.read_row(step, 0, out=buffer)
                best_h5 = min(best_h5, time.perf_counter() - start)
                start = time.perf_counter()
                for offset, first, end in pieces:
                    os.preadv(fd, [target[first:end]], offset)
                best_raw = min(best_raw, time.perf_counter() - start)
        finally:
            os.close(fd)
    if not np.array_equal(raw, buffer):
        raise RuntimeError("the raw read does not give the row read_row gives")
    return best_raw / best_h5


def write_with(tree: str | None, folder: Path, numel: int, learners: int, steps: int) -> None:
    """:func:`write_synthetic` by the writer of source tree ``tree`` (None: this one), in
    a fresh process: an older tree cannot read a newer tree's schema, so with ``--base``
    each tree reads the same values in the capture format of its own writer."""
    if tree is None:
        write_synthetic(folder, numel, learners, steps)
        return
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        "from pathlib import Path; from scale import write_synthetic; "
        f"write_synthetic(Path({str(folder)!r}), {numel}, {learners}, {steps})"
    )
    env = {**os.environ, "PYTHONPATH": tree}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=tempfile.gettempdir())


def warm_up(args: argparse.Namespace) -> None:
    """Each analysis once per tree on a small capture, untimed: numba compiles a loop
    on its first call after its source changed (seconds), then loads it from its cache
    (a tree's first timed run would otherwise pay the compile)."""
    for tree in {None, args.base}:
        folder = args.dir / "scale-warm-up"
        if folder.exists():
            shutil.rmtree(folder)
        write_with(tree, folder, 1 << 22, 2, 2)
        try:
            for what in args.analyses.split(","):
                for plain in [""] + ([] if tree else args.plain.split(",")):
                    run_child(folder, what, tree=tree, plain=plain)
        finally:
            shutil.rmtree(folder)


def floors(folder: Path, repeats: int, tree: str | None = None, plain: str = "") -> dict:
    """The read floors of a capture: every row, learner 0's rows, the first touch."""
    return {
        what: median_run(folder, what, repeats, tree=tree, plain=plain)[0]
        for what in ("read", "read-one", "touch")
    }


def main() -> None:
    args = parse_args()
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    header = (
        f"{'numel':>6} {'n':>3} {'analysis':>12} {'s/step':>8} {'x read':>7} "
        f"{'peak RSS':>9} {'RSS target':>10} {'x read+touch':>12}"
        + (f" {'busy/quiet':>10}" if args.busy else "")
        + (f" {'new/base':>8} {'base x read':>11}" if args.base else "")
        + "".join(f" {'/-' + name:>9}" for name in filter(None, args.plain.split(",")))
    )
    print(header)
    warm_up(args)
    for size in args.sizes.split(","):
        for learners in (int(n) for n in args.learners.split(",")):
            folders = {None: args.dir / f"scale-{size}-{learners}"}
            if args.base:
                folders[args.base] = args.dir / f"scale-{size}-{learners}-base"
            for tree, folder in folders.items():
                if folder.exists():
                    shutil.rmtree(folder)
                write_with(tree, folder, SIZES[size], learners, args.steps)
            try:
                run_size(args, size, learners, folders)
            finally:
                for folder in folders.values():
                    shutil.rmtree(folder)
    print(f"load average after: {os.getloadavg()[0]:.1f}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8M,32M,128M", help="numel per learner: 8M,32M,128M")
    parser.add_argument("--learners", default="4,16")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--repeats", type=int, default=1, help="fresh runs of each, the median time is printed"
    )
    parser.add_argument("--dir", type=Path, default=Path("/work/tmp-scale"))
    parser.add_argument(
        "--analyses",
        default="similarity,buildup,overlap,noise,consistency,fit,replay-topk,replay-dgc",
        help="comma-separated",
    )
    parser.add_argument("--busy", action="store_true", help="also time each with a CPU hog")
    parser.add_argument(
        "--plain",
        default="",
        help=f"fast paths to time without, one at a time, comma-separated: {', '.join(PLAIN)};"
        " a column /-NAME each: the time with it over the time without it (this tree)",
    )
    parser.add_argument(
        "--base",
        help="another source tree (e.g. /work/wt/base): each analysis also runs from it, "
        "alternating, on a capture of the same values its own writer made; the line ends "
        "with this tree's time over the base's and the base's time over its own read",
    )
    return parser.parse_args()


def run_size(args: argparse.Namespace, size: str, learners: int, folders: dict) -> None:
    """Every analysis on the captures of one size and learner count (``folders``: tree
    -> capture), one line each."""
    numel, folder = SIZES[size], folders[None]
    floor = floors(folder, args.repeats)
    base_floor = floors(folders[args.base], args.repeats, args.base) if args.base else {}
    k = max(1, round(RATIO * numel))
    target = 600e6 + 3 * numel * 4 + 16 * learners * k
    print(
        f"{size:>6} {learners:>3} {'h5py/raw':>12} raw/h5py read {raw_vs_h5py(folder, numel):.2f}"
    )
    print(f"{size:>6} {learners:>3} {'read':>12} {floor['read'] / args.steps:8.2f}")
    print(f"{size:>6} {learners:>3} {'touch':>12} {floor['touch']:8.2f} (once)")
    others = [(folders[args.base], args.base, "")] if args.base else []
    others += [(folder, None, name) for name in filter(None, args.plain.split(","))]
    for what in args.analyses.split(","):
        floor_of = "read-one" if what == "fit" else "read"
        seconds, peak = median_run(folder, what, args.repeats)
        befores = [median_run(f, what, args.repeats, tree=t, plain=n)[0] for f, t, n in others]
        if others:  # alternating: this tree, the others, this tree again
            again, peak_again = median_run(folder, what, args.repeats)
            seconds, peak = statistics.median([seconds, again]), max(peak, peak_again)
        column = "".join(f" {seconds / before:8.2f}" for before in befores[: bool(args.base)])
        if args.base:
            column += f" {befores[0] / base_floor[floor_of]:11.2f}"
        column += "".join(f" {seconds / before:9.2f}" for before in befores[bool(args.base) :])
        allowance = target + (learners * numel * 4 if "replay" in what else 0)
        touched = floor["read"] + floor["touch"]
        with_touch = f"{seconds / touched:12.2f}" if "replay" in what else ""
        busy = ""
        if args.busy:
            loaded, _ = median_run(folder, what, args.repeats, busy=True)
            busy = f" {loaded / seconds:10.2f}"
        print(
            f"{size:>6} {learners:>3} {what:>12} {seconds / args.steps:8.2f} "
            f"{seconds / floor[floor_of]:7.2f} {peak / 1e6:7.0f}MB {allowance / 1e6:8.0f}MB "
            f"{with_touch:>12}{busy}{column}",
            flush=True,
        )


if __name__ == "__main__":
    main()
