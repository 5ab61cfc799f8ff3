"""Threshold estimators vs exact top-k on one 25M-element gradient-like vector.

Prints, for ratios 0.01 and 0.001, each estimator's median time divided by the median
time of ``torch.topk(g.abs(), k)`` on the same signed vector, measured interleaved in
the same run, and its estimation quality q = selected / k. SIDCo's GPD stages run
fitted by moments and by maximum likelihood (``fit`` column).
Target (issue 3): SIDCo-P with 3 stages at most 0.35 of top-k's time with q in [0.8, 1.25].

The vector: 100 "layers" whose scales spread over two decades (log-uniform), values
Student-t with 3 degrees of freedom (heavy tails, as gradients have) and 2% exact zeros
(dead units); or ``--capture PATH``: every (step, learner) flat gradient of a real
capture (times summed over them; q as median (min-max)).

    .venv/bin/python benchmarks/thresholds.py [--capture PATH [--rows N]] [--repeats 3]
                                              [--estimators A,B]
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


def from_capture(path: str) -> list[torch.Tensor]:
    """Every (step, learner) flat gradient of a capture."""
    from gradstat.store import open_capture

    with open_capture(path) as cap:
        return [row.clone() for step in cap.steps for row in cap.read_step(int(step))]


def _quality(results: list) -> str:
    """q of one vector, or the median (min-max) over many."""
    qs = [r.quality for r in results]
    if len(qs) == 1:
        return f"{qs[0]:.3f}"
    return f"{statistics.median(qs):.2f} ({min(qs):.2f}-{max(qs):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--capture", help="use every gradient of a real capture instead")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--estimators", help="only these (comma list; default: all below)")
    parser.add_argument("--rows", type=int, help="with --capture: this many rows, evenly spaced")
    args = parser.parse_args()
    wanted = args.estimators.split(",") if args.estimators else [run[0] for run in RUNS]
    runs = [run for run in RUNS if run[0] in wanted]
    vectors = from_capture(args.capture) if args.capture else [gradient_like()]
    if args.rows:
        vectors = vectors[:: max(1, len(vectors) // args.rows)][: args.rows]
    source = f"{len(vectors)} rows of {args.capture}" if args.capture else "synthetic"
    print(
        f"{vectors[0].numel():,} values ({source}), torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, median of {args.repeats} interleaved runs"
    )
    for ratio in RATIOS:
        k = k_for(ratio, vectors[0].numel())
        print(f"\nratio {ratio:g} (k = {k:,})")
        print(f"{'estimator':<18}{'stages':>7}{'fit':>8}{'time/topk':>11}  q")
        timings: dict[str, list[float]] = {"topk": []}
        results: dict[str, list] = {}
        for _ in range(args.repeats):
            start = time.perf_counter()
            for values in vectors:
                torch.topk(values.abs(), k, sorted=False)
            timings["topk"].append(time.perf_counter() - start)
            for estimator, stages, stage_fit in runs:
                key = f"{estimator}/{stages}/{stage_fit}"
                generator = torch.Generator().manual_seed(0)
                start = time.perf_counter()
                results[key] = [
                    estimate_threshold(
                        values,
                        ratio,
                        estimator,
                        stages=stages,
                        generator=generator,
                        stage_fit=stage_fit,
                    )
                    for values in vectors
                ]
                timings.setdefault(key, []).append(time.perf_counter() - start)
        base = statistics.median(timings["topk"])
        per_vector = base / len(vectors) * 1e3
        print(f"{'topk':<18}{1:>7}{'':>8}{1.0:>11.3f}  1   ({per_vector:.0f} ms per vector)")
        for estimator, stages, stage_fit in runs:
            key = f"{estimator}/{stages}/{stage_fit}"
            ratio_time = statistics.median(timings[key]) / base
            fit = stage_fit if estimator.startswith("sidco") else ""
            print(
                f"{estimator:<18}{stages:>7}{fit:>8}{ratio_time:>11.3f}  {_quality(results[key])}"
            )


if __name__ == "__main__":
    main()
