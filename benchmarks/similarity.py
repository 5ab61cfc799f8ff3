"""Similarity + build-up of one step: gradstat's tensor version against a numpy-set baseline.

One step of 8 learners x 5M elements (a shared Laplace component plus each learner's own,
so the sets overlap as real gradients' do), ratio 0.001 and 0.01. Both sides compute the
same statistics: each learner's and the mean gradient's top-k set, all pairwise
intersections (overlap, Jaccard, Hamming), energy captured, union, full intersection and
the build-up curve B(m) averaged exactly over all learner subsets.

* ours: ``topk_set_metrics`` (``topk_indices``: exact top-k with a sampled-threshold
  prefilter; one membership mask; holder-count histogram) + ``buildup_curve``
  (hypergeometric average from the multiplicity histogram).
* baseline: ``np.argpartition`` top-k, ``np.intersect1d`` / ``np.union1d`` for every pair,
  ``reduce(np.union1d)`` / ``reduce(np.intersect1d)``, and the union of every one of the
  2^n - 1 learner subsets (each built from a smaller one with one ``np.union1d``).

Prints medians of a few repeats and their RATIOS (baseline / ours), end to end (the sum
of the baseline's two parts) and split into top-k selection and set metrics, with torch
on its default threads and on one (numpy is single-threaded; on a shared, loaded machine
torch's OpenMP threads can lose more to waiting than they gain).

Run: ``.venv/bin/python benchmarks/similarity.py``
"""

from __future__ import annotations

import statistics
import time
from functools import reduce

import numpy as np
import torch

from gradstat.analysis.selection import k_for
from gradstat.stats.topk_sets import topk_indices, topk_set_metrics

N, D, REPEATS = 8, 5_000_000, 3


def ours_sets(x: torch.Tensor, k: int) -> torch.Tensor:
    return torch.cat([topk_indices(x, k), topk_indices(x.mean(dim=0), k)[None]])


def ours(x: torch.Tensor, k: int) -> tuple[float, np.ndarray]:
    metrics = topk_set_metrics(x, k)
    curve = metrics.buildup_curve()
    return metrics.full_intersection, curve.numpy()


def baseline_sets(g: np.ndarray, k: int) -> list[np.ndarray]:
    rows = [*g, g.mean(axis=0)]
    return [np.argpartition(np.abs(row), -k)[-k:] for row in rows]


def baseline_metrics(sets: list[np.ndarray], mean: np.ndarray, k: int):
    n = len(sets) - 1
    sets = [np.sort(s) for s in sets]
    pairs = {}
    for a in range(n + 1):
        for b in range(a + 1, n + 1):
            inter = np.intersect1d(sets[a], sets[b], assume_unique=True).size
            union = np.union1d(sets[a], sets[b]).size
            pairs[a, b] = (inter / k, inter / union, 2 * (k - inter))
    energy = [
        np.sum(mean[s].astype(np.float64) ** 2) / np.sum(mean.astype(np.float64) ** 2) for s in sets
    ]
    full = reduce(lambda a, b: np.intersect1d(a, b, assume_unique=True), sets[:n]).size / k
    unions = {0: np.zeros(0, dtype=sets[0].dtype)}
    sizes = np.zeros(n + 1)
    counts = np.zeros(n + 1)
    for mask in range(1, 1 << n):
        top = mask.bit_length() - 1
        unions[mask] = np.union1d(unions[mask & ~(1 << top)], sets[top])
        m = mask.bit_count()
        sizes[m] += unions[mask].size
        counts[m] += 1
    return pairs, energy, full, sizes[1:] / counts[1:]


def timed(repeats: int, fn, *args):
    """(median seconds over ``repeats`` calls, the last call's result)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    rng = np.random.default_rng(0)
    g = (rng.laplace(size=(1, D)) + rng.laplace(size=(N, D))).astype(np.float32)
    x = torch.from_numpy(g)
    threads = torch.get_num_threads()
    print(f"{N} learners x {D:,} elements; medians of {REPEATS}; numpy is single-threaded")
    for ratio in (0.001, 0.01):
        k = k_for(ratio, D)
        # the numpy subset unions take ~10 s a run at ratio 0.01: one run there
        base_repeats = REPEATS if ratio < 0.005 else 1
        t_sel_base, sets = timed(REPEATS, baseline_sets, g, k)
        t_set_base, (_, _, full_ref, curve_ref) = timed(
            base_repeats, baseline_metrics, sets, g.mean(axis=0), k
        )
        t_base = t_sel_base + t_set_base
        print(
            f"ratio {ratio:g} (k={k:,}): numpy-set baseline {t_base * 1e3:.0f} ms "
            f"(argpartition {t_sel_base * 1e3:.0f} ms + set metrics {t_set_base * 1e3:.0f} ms"
            f"{'' if base_repeats > 1 else ', 1 run'})"
        )
        for n_threads in dict.fromkeys((1, threads)):
            torch.set_num_threads(n_threads)
            t_ours, (full, curve) = timed(REPEATS, ours, x, k)
            t_sel_ours, _ = timed(REPEATS, ours_sets, x, k)
            assert abs(full - full_ref) < 1e-12 and np.allclose(curve, curve_ref), "differ"
            t_set_ours = t_ours - t_sel_ours  # ours does both in one call: subtract selection
            print(
                f"    torch on {n_threads} thread(s): baseline / ours = {t_base / t_ours:.1f}x "
                f"end to end (ours {t_ours * 1e3:.0f} ms); top-k selection "
                f"{t_sel_base / t_sel_ours:.1f}x, set metrics {t_set_base / t_set_ours:.1f}x "
                f"(ours {t_sel_ours * 1e3:.0f} + {t_set_ours * 1e3:.0f} ms)"
            )
        torch.set_num_threads(threads)


if __name__ == "__main__":
    main()
