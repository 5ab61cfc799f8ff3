"""Threshold estimators vs exact top-k on one 25M-element gradient-like vector.

Prints, for ratios 0.01 and 0.001, each estimator's median time divided by the median
time of ``torch.topk(g.abs(), k)`` on the same signed vector, measured interleaved in
the same run, and its estimation quality q = selected / k. SIDCo's GPD stages run
fitted by moments and by maximum likelihood (``fit`` column).
Target (issue 3): SIDCo-P with 3 stages at most 0.35 of top-k's time with q in [0.8, 1.25].

The vector: 100 "layers" whose scales spread over two decades (log-uniform), values
Student-t with 3 degrees of freedom (heavy tails, as gradients have) and 2% exact zeros
(dead units); or ``--capture PATH``: the flat gradient of learner 0 at the first step
of a real capture.

    .venv/bin/python benchmarks/thresholds.py [--capture PATH] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from gradstat.stats.density import k_for
from gradstat.stats.thresholds import estimate_threshold

SIZE = 25_000_000
RATIOS = (0.01, 0.001)
RUNS = (  # (estimator, stages, stage fit)
    ("sidco-exp", 3, "moments"),
    ("sidco-gpd", 1, "moments"),
    ("sidco-gpd", 3, "moments"),
    ("sidco-gpd", 3, "mle"),
    ("sidco-gamma-gpd", 3, "moments"),
    ("sidco-gamma-gpd", 3, "mle"),
    ("dgc", 1, "moments"),
    ("gaussiank", 1, "moments"),
    ("redsync", 1, "moments"),
    ("redsync-sidco", 1, "moments"),
)


def gradient_like(size: int = SIZE, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    layers = 100
    scales = np.repeat(10.0 ** rng.uniform(-4, -2, layers), size // layers)
    values = rng.standard_t(3, size=size).astype(np.float32) * scales.astype(np.float32)
    values[rng.random(size) < 0.02] = 0.0
    return torch.from_numpy(values)


def from_capture(path: str) -> torch.Tensor:
    from gradstat.store import open_capture

    with open_capture(path) as cap:
        return cap.read_step(int(cap.steps[0]), [0])[0].clone()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--capture", help="use a real capture's gradient instead")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    values = from_capture(args.capture) if args.capture else gradient_like()
    source = args.capture or "synthetic gradient-like vector"
    print(
        f"{values.numel():,} values ({source}), torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, median of {args.repeats} interleaved runs"
    )
    for ratio in RATIOS:
        k = k_for(ratio, values.numel())
        print(f"\nratio {ratio:g} (k = {k:,})")
        print(f"{'estimator':<18}{'stages':>7}{'fit':>8}{'time/topk':>11}{'q':>8}")
        timings: dict[str, list[float]] = {"topk": []}
        results = {}
        for _ in range(args.repeats):
            start = time.perf_counter()
            torch.topk(values.abs(), k, sorted=False)
            timings["topk"].append(time.perf_counter() - start)
            for estimator, stages, stage_fit in RUNS:
                key = f"{estimator}/{stages}/{stage_fit}"
                generator = torch.Generator().manual_seed(0)
                start = time.perf_counter()
                results[key] = estimate_threshold(
                    values,
                    ratio,
                    estimator,
                    stages=stages,
                    generator=generator,
                    stage_fit=stage_fit,
                )
                timings.setdefault(key, []).append(time.perf_counter() - start)
        base = statistics.median(timings["topk"])
        print(f"{'topk':<18}{1:>7}{'':>8}{1.0:>11.3f}{1.0:>8.3f}   ({base * 1e3:.0f} ms)")
        for estimator, stages, stage_fit in RUNS:
            key = f"{estimator}/{stages}/{stage_fit}"
            ratio_time = statistics.median(timings[key]) / base
            fit = stage_fit if estimator.startswith("sidco") else ""
            quality = results[key].quality
            print(f"{estimator:<18}{stages:>7}{fit:>8}{ratio_time:>11.3f}{quality:>8.3f}")


if __name__ == "__main__":
    main()
