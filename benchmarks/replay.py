"""Replay throughput against torch.topk, and whether a replay streams.

1. Throughput: one step of 4 learners x 2^17 elements (a shared Laplace component plus
   each learner's own), ratio 0.01. For every registered compressor, the time of one
   replay step (error-feedback compensate + compress + aggregate + memory update, all 4
   learners) against the time of ``torch.topk`` of the 4 learners' magnitudes at the
   same k on the same data. Printed: throughput ratio = topk time / compressor time
   (1 = as fast as a bare torch.topk; error feedback and the aggregate alone cost more
   than topk, so exact top-k itself sits below 1). Medians of 3 repeats, each compressor
   step timed alternately with the bare top-k after a warm-up of both; torch on one
   thread so the figures depend less on the other jobs of this shared 2-core machine.
2. Streaming: peak resident memory added by a replay of topk, dgc, sidco-gpd, clt-k and
   powersgd over 10 recorded steps against one over 100 steps of the same capture
   (4 learners x 2^16 elements, 1 MiB a step), each in a fresh process after a 2-step
   warm-up replay of the same compressors (first use of each kernel costs memory once):
   peak RSS from /proc/self/status VmHWM after resetting it via /proc/self/clear_refs,
   minus the RSS before the replay. glibc's malloc is told to serve blocks >= 128 KiB by
   mmap (``MALLOC_MMAP_THRESHOLD_``) so that freed step tensors leave the RSS at once
   and the peak follows live memory, not the allocator's retained free lists (without
   it the ratio wanders between 1.1 and 2.5 from run to run on this machine, with the
   RSS flat over steps). A replay that streams keeps the ratio (100 / 10) near 1; the
   target is at most 1.2. ``--memory-only`` runs just this part.

Run: ``.venv/bin/python benchmarks/replay.py``
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from gradstat.analysis.replay_block import replay_rows
from gradstat.analysis.selection import k_for
from gradstat.compressors import REGISTRY, build_plan, build_scheme, parse_compressors
from gradstat.store import layer_table

N, D, RATIO, REPEATS = 4, 1 << 17, 0.01, 3
SHAPES = [(256, 508), (1024,)]  # one matrix for PowerSGD plus a bias: 2^17 in all
MEMORY_D, MEMORY_STEPS = 1 << 16, 100
MEMORY_LAYERS = [("w", (256, 252)), ("b", (1024,))]
COMPRESSORS = "topk,dgc,sidco-gpd,clt-k,powersgd"


def data(steps: int, n: int, d: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    shared = rng.laplace(size=(1, steps, d))
    return (shared + 0.5 * rng.laplace(size=(n, steps, d))).astype(np.float32)


def paired_medians(first, second, repeats: int = REPEATS) -> tuple[float, float]:
    """Median seconds of ``first`` and ``second``, timed alternately (after a warm-up of
    each) so that drift in the machine's load hits both alike."""
    first()
    second()
    a, b = [], []
    for _ in range(repeats):
        for fn, times in ((first, a), (second, b)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(a), statistics.median(b)


def throughput() -> None:
    grads = torch.from_numpy(data(1, N, D)[:, 0])
    k = k_for(RATIO, D)
    magnitudes = grads.abs()

    def bare_topk() -> None:
        for row in magnitudes:
            torch.topk(row, k, sorted=False)

    print(f"throughput, {N} learners x {D:,} elements, ratio {RATIO}, torch threads 1")
    print(f"  {'compressor':<16} {'ms/step':>9} {'torch.topk ms':>14} {'throughput / topk':>18}")
    for name, entry in REGISTRY.items():
        (spec,) = parse_compressors(name)
        ratio = None if entry.fixed_rate else RATIO
        plan = build_plan(layer_table([(f"p{i}", shape) for i, shape in enumerate(SHAPES)]))
        scheme = build_scheme(spec, ratio, plan, seed=0)
        seconds, topk_seconds = paired_medians(
            lambda scheme=scheme: replay_rows(scheme, grads), bare_topk
        )
        print(
            f"  {name:<16} {seconds * 1e3:>9.1f} {topk_seconds * 1e3:>14.1f} "
            f"{topk_seconds / seconds:>18.3f}"
        )


_CHILD = """
import re, sys
from pathlib import Path
from gradstat.analysis.replay import ReplayParams, replay
from gradstat.analysis.selection import Selection
from gradstat.compressors import parse_link
from gradstat.store import open_capture

def status(key):
    text = Path("/proc/self/status").read_text()
    return int(re.search(key + r":\\s+(\\d+) kB", text).group(1)) * 1024

path, steps, compressors = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with open_capture(path) as cap:
    spec = f"{cap.steps[0]}:{cap.steps[steps - 1] + 1}"
    link = parse_link("10Gbit/s", "5us")
    params = ReplayParams(compressors, "0.01", link)
    replay(cap, Selection.of(cap, f"{cap.steps[0]}:{cap.steps[1] + 1}"), params)
    before = status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    records = replay(cap, Selection.of(cap, spec), params)
    peak = status("VmHWM")
print(peak - before, len(records))
"""


def peak_memory() -> None:
    from gradstat.store import layer_table, write_capture

    with tempfile.TemporaryDirectory() as tmp:
        path = write_capture(
            Path(tmp) / "cap",
            data(MEMORY_STEPS, N, MEMORY_D, seed=1),
            layer_table(MEMORY_LAYERS),
        )
        peaks = {}
        for steps in (10, MEMORY_STEPS):
            out = subprocess.run(
                [sys.executable, "-c", _CHILD, str(path), str(steps), COMPRESSORS],
                capture_output=True,
                text=True,
                check=True,
                env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)},
            )
            added, rows = out.stdout.split()
            peaks[steps] = int(added)
            print(
                f"  replay over {steps:>3} steps: peak RSS added {int(added) / 2**20:7.1f} MiB "
                f"({rows} records)"
            )
    one_step = N * MEMORY_D * 4 / 2**20
    print(f"  (one step of all learners: {one_step:.1f} MiB)")
    print(f"  peak memory ratio, 100 steps / 10 steps: {peaks[MEMORY_STEPS] / peaks[10]:.3f}")


def main() -> None:
    torch.set_num_threads(1)
    if "--memory-only" not in sys.argv:
        throughput()
    print(f"streaming, {N} learners x {MEMORY_D:,} elements, {COMPRESSORS} at 0.01")
    peak_memory()


if __name__ == "__main__":
    main()
