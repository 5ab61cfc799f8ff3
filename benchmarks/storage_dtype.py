"""Do 2-byte storage types keep the statistics? Real captured rows, float32 vs rounded.

For every (step, learner) row of a float32 capture it rounds the row to bfloat16 and to
float16 exactly as ``capture --dtype`` stores it (torch's round to nearest even; the
tests check the stored rows are these) and compares, against the same row in float32:

* KS of the GPD fitted (moments) to the non-zero magnitudes (same subsample of positions),
* q = selected / k of SIDCo-P (``sidco-gpd``, 3 stages) at ratio 0.001, as |q16 - q32| / q32,
* the overlap |top-k(float32) n top-k(rounded)| / k of the top-k sets at 0.01 and 0.001.

Goal (issue 14): overlap >= 0.99 and q within 1%.

    python benchmarks/storage_dtype.py CAPTURE [CAPTURE ...] [--markdown]
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch

from gradstat import open_capture
from gradstat.stats.density import k_for
from gradstat.stats.distributions import GenPareto
from gradstat.stats.goodness import ks_ad
from gradstat.stats.thresholds import estimate_threshold
from gradstat.stats.topk_sets import topk_indices

DTYPES = ("bfloat16", "float16")
OVERLAP_RATIOS = (0.01, 0.001)
Q_RATIO = 0.001
KS_SAMPLE = 200_000


def rounded(row: torch.Tensor, dtype: str) -> torch.Tensor:
    """The float32 values a row of ``dtype`` storage reads back as."""
    return row.to(getattr(torch, dtype)).float()


def gpd_ks(row: torch.Tensor, positions: torch.Tensor) -> float:
    magnitudes = row[positions].abs()
    magnitudes = magnitudes[magnitudes > 0]
    return ks_ad(magnitudes, GenPareto.fit(magnitudes, "moments"))[0]


def topk_overlap(a: torch.Tensor, b: torch.Tensor, ratio: float) -> float:
    k = k_for(ratio, a.numel())
    common = np.intersect1d(topk_indices(a, k).numpy(), topk_indices(b, k).numpy())
    return common.size / k


def compare(path: str) -> dict[str, dict[str, list[float]]]:
    """Per storage type, per metric: one value per (step, learner) row."""
    results = {dtype: {} for dtype in DTYPES}
    with open_capture(path) as cap:
        if cap.dtype != "float32":
            raise SystemExit(f"{path}: a float32 capture is needed, this one is {cap.dtype}")
        rng = np.random.default_rng(0)
        positions = torch.from_numpy(
            np.sort(rng.choice(cap.numel, min(KS_SAMPLE, cap.numel), replace=False))
        )
        for _, grads in cap.iter_steps():
            for row in grads:
                ks32 = gpd_ks(row, positions)
                q32 = estimate_threshold(row, Q_RATIO, "sidco-gpd").quality
                for dtype in DTYPES:
                    low = rounded(row, dtype)
                    metrics = results[dtype]
                    q16 = estimate_threshold(low, Q_RATIO, "sidco-gpd").quality
                    ks16 = gpd_ks(low, positions)
                    metrics.setdefault("ks32", []).append(ks32)
                    metrics.setdefault("ks", []).append(ks16)
                    metrics.setdefault("dks", []).append(abs(ks16 - ks32))
                    metrics.setdefault("q32", []).append(q32)
                    metrics.setdefault("dq", []).append(abs(q16 - q32) / q32)
                    metrics.setdefault("zeros", []).append(
                        float((low == 0).sum() - (row == 0).sum()) / row.numel()
                    )
                    for ratio in OVERLAP_RATIOS:
                        key = f"overlap@{ratio:g}"
                        metrics.setdefault(key, []).append(topk_overlap(row, low, ratio))
        label = f"{cap.workload} {cap.meta.get('size', '')} ({cap.numel:,} values, "
        label += f"{len(cap.steps)} steps x {len(cap.learners)} learners)"
    return {"label": label, **results}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("captures", nargs="+", help="float32 capture folders")
    args = parser.parse_args()
    print(
        "| capture | stored as | top-k overlap @0.01: median (min) | @0.001: median (min) | "
        "SIDCo-P q@0.001: abs(dq)/q median (max) | GPD KS: float32 -> stored, median | "
        "abs(dKS) max | new zeros: max |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for path in args.captures:
        result = compare(path)
        for dtype in DTYPES:
            m = result[dtype]
            overlaps = [
                f"{statistics.median(m[f'overlap@{r:g}']):.4f} ({min(m[f'overlap@{r:g}']):.4f})"
                for r in OVERLAP_RATIOS
            ]
            dq = f"{statistics.median(m['dq']) * 100:.2f}% ({max(m['dq']) * 100:.2f}%)"
            ks = f"{statistics.median(m['ks32']):.4f} -> {statistics.median(m['ks']):.4f}"
            print(
                f"| {result['label']} | {dtype} | {overlaps[0]} | {overlaps[1]} | {dq} | {ks} "
                f"| {max(m['dks']):.4f} | {max(m['zeros']) * 100:.3g}% |"
            )


if __name__ == "__main__":
    main()
