"""Calibration of the compression work model (gradstat/compressors/work.py) on this CPU.

For every registered compressor (sparsifiers at ratio 0.01) and 2-3 model sizes (one
message), one learner's measured compression time in training with 2 learners (its
memory, compress, decoding the payloads it receives and aggregating: the price
``recommend`` measures here, gradstat/analysis/pricing.py) against the work model's
prediction with the ``cpu-here`` profile measured in the same run (``Work.online``), the
estimate other targets get. Printed: measured ms, predicted ms and predicted / measured
(1 = exact). Torch runs on one thread (replay's default); the price is the median of
warm runs, timed as the thread's CPU time like the profile (the machine is shared, wall
time would measure the other jobs); the gradients are a shared Laplace component plus
each learner's own.

Run: ``.venv/bin/python benchmarks/cost_model.py [--sizes 1048576,4194304] [--json]``
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from gradstat.analysis.pricing import measure_price
from gradstat.compressors.plan import build_plan
from gradstat.compressors.registry import REGISTRY, build_scheme
from gradstat.compressors.spec import parse_compressors
from gradstat.compressors.targets import measure
from gradstat.compressors.work import seconds
from gradstat.store import layer_table

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
            plan = build_plan(layer_table([(f"p{i}", shape) for i, shape in enumerate(shapes)]))
            scheme = build_scheme(spec, ratio, plan, seed=0)
            measured = measure_price(scheme, gradients(d, 0)[0], LEARNERS).at(LEARNERS)
            work = scheme.compressor(0, 0).work(d, scheme.memory)
            predicted = seconds(work.online(LEARNERS), target)
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
