"""Coverage of ``gradstat noise``'s interval: how often it holds the true B_simple.

Draws n learners' gradients g_i = G + noise of variance sigma^2 / b per element (d
elements; the truth is B_simple = d sigma^2 / |G|^2), takes their Gram matrix and the
interval of :func:`gradstat.analysis.noise.interval` (Hesterberg's expanded percentile
bootstrap over learners), and beside it the plain percentile interval of the same
resamples; prints the share of draws whose interval holds the truth (docs/noise.md).

    python benchmarks/noise_interval.py --draws 200
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from gradstat.analysis.noise import NoiseParams, interval

#: (learners, d, b, |G|): B_simple = d / |G|^2 at sigma = 1.
CASES = [
    (3, 10_000, 32, 20.0),
    (4, 10_000, 32, 20.0),
    (8, 10_000, 32, 20.0),
    (16, 4_000, 16, 10.0),
    (32, 2_000, 8, 10.0),
    (8, 10_000, 32, 3.0),
]


def plain_interval(gram: np.ndarray, b: int, rng: np.random.Generator, params: NoiseParams):
    """The plain 95% percentile interval of the same resampled statistic."""
    n = len(gram)
    counts = rng.multinomial(n, np.full(n, 1.0 / n), size=params.resamples).astype(float)
    diag = np.diag(gram)
    pairs = n * n - (counts**2).sum(axis=1)
    cross = ((counts @ gram) * counts).sum(axis=1) - (counts**2) @ diag
    norms = (counts * (n - counts)) @ diag
    share = cross[pairs > 0] / norms[pairs > 0]
    low, high = np.quantile(share, [(1 - params.confidence) / 2, (1 + params.confidence) / 2])
    return b * (1 / high - 1), (b * (1 / low - 1) if low > 0 else math.inf)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=200)
    args = parser.parse_args()
    params = NoiseParams(batch_size=1)
    print(f"{'n':>3} {'d':>7} {'b':>3} {'truth':>8} {'plain':>6} {'expanded':>8}  (nan: left out)")
    for n, d, b, signal in CASES:
        truth = d / signal**2
        held = {"plain": 0.0, "expanded": 0.0}
        for seed in range(args.draws):
            rng = np.random.default_rng(seed)
            g = rng.standard_normal(d)
            g *= signal / np.linalg.norm(g)
            rows = g + rng.standard_normal((n, d)) / math.sqrt(b)
            gram = rows @ rows.T
            for name, method in (("plain", plain_interval), ("expanded", interval)):
                low, high = method(gram, b, np.random.default_rng([seed, 1]), params)
                held[name] += math.nan if math.isnan(low) else low <= truth <= high
        print(
            f"{n:>3} {d:>7} {b:>3} {truth:>8.4g} {held['plain'] / args.draws:>6.3f} "
            f"{held['expanded'] / args.draws:>8.3f}"
        )


if __name__ == "__main__":
    main()
