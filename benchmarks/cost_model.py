"""Calibration of the compression work model (gradstat/compressors/work.py) on this CPU.

For every registered compressor (sparsifiers at ratio 0.01) and 2-3 scope sizes, the
replay's measured compression time per learner (compensate + compress + aggregate +
memory update of 2 learners, divided by 2: what ``gradstat replay`` reports as
``compress ms``) against the work model's prediction with the ``cpu-here`` profile
measured in the same run (``Work.replay``). Printed: measured ms, predicted ms and
predicted / measured (1 = exact). Torch runs on one thread (replay's default), each
figure is the smallest of 3 steps after 2 warm-up steps of the same scheme (its memory
filled), timed as the thread's CPU time like the profile (the machine is shared, wall
time would measure the other jobs); the gradients are a shared Laplace component plus
each learner's own.

Run: ``.venv/bin/python benchmarks/cost_model.py [--sizes 1048576,4194304] [--json]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from gradstat.analysis.selection import k_for
from gradstat.compressors.registry import REGISTRY, build_scheme
from gradstat.compressors.spec import parse_compressors
from gradstat.compressors.targets import measure
from gradstat.compressors.work import compressor_work, seconds

LEARNERS = 2
RATIO = 0.01


def gradients(d: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    laplace = torch.distributions.Laplace(0.0, 1.0)
    shared = laplace.sample((d,))
    own = torch.randn(LEARNERS, d, generator=generator)
    return (shared + 0.5 * own).float()


def calibrate(sizes: list[int]) -> list[dict]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    target = measure("cpu")
    rows = []
    for name in REGISTRY:
        spec = parse_compressors(name)[0]
        for d in sizes:
            side = int(d**0.5)
            shapes = [(side, d // side), (d - side * (d // side),)] if d % side else [(side, side)]
            ratio = None if spec.fixed_rate else RATIO
            k = None if ratio is None else k_for(ratio, d)
            scheme = build_scheme(spec, ratio, k, numel=d, shapes=shapes, seed=0)
            times = []
            for step in range(5):
                grads = gradients(d, step)
                start = time.thread_time()
                scheme.step(grads)
                times.append((time.thread_time() - start) / LEARNERS)
            measured = min(times[2:])
            work = compressor_work(scheme.compressor, scheme.memory, d)
            predicted = seconds(work.replay(LEARNERS), target)
            rows.append(
                {
                    "compressor": name,
                    "numel": d,
                    "measured_ms": measured * 1e3,
                    "predicted_ms": predicted * 1e3,
                    "ratio": predicted / measured if measured > 0 else float("nan"),
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="262144,1048576,4194304")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = calibrate([int(s) for s in args.sizes.split(",")])
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'compressor':<16} {'numel':>9} {'measured ms':>12} {'model ms':>9} {'model/meas':>10}")
    for r in rows:
        print(
            f"{r['compressor']:<16} {r['numel']:>9,} {r['measured_ms']:>12.3f} "
            f"{r['predicted_ms']:>9.3f} {r['ratio']:>10.2f}"
        )
    ratios = [r["ratio"] for r in rows if r["measured_ms"] > 0.05]
    print(
        f"median model/measured {statistics.median(ratios):.2f}, "
        f"range {min(ratios):.2f}-{max(ratios):.2f}"
    )


if __name__ == "__main__":
    main()
