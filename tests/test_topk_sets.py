"""Top-k set metrics against brute force (numpy set routines) and constructed cases."""

from __future__ import annotations

import itertools
import warnings
from functools import reduce

import numpy as np
import pytest
import torch
from scipy.stats import hypergeom

from gradstat.analysis.ef_vectors import replay_steps
from gradstat.errors import GradstatWarning
from gradstat.stats.passes import RowPasses
from gradstat.stats.topk_sets import (
    buildup_curve,
    candidates_room,
    contraction_ok,
    energy_captured,
    indices_above,
    paired_intersection_sizes,
    prefilter_threshold,
    random_overlap,
    random_union,
    set_overlaps,
    topk_indices,
    topk_set_metrics,
)


def _random_grads(n: int, d: int, seed: int, shared: float = 1.0) -> torch.Tensor:
    """Learners = shared Laplace component + own noise (continuous: no ties)."""
    rng = np.random.default_rng(seed)
    common = rng.laplace(size=(1, d))
    return torch.from_numpy(shared * common + rng.laplace(size=(n, d)))


def _brute_topk(x: np.ndarray, k: int) -> np.ndarray:
    return np.sort(np.argsort(-np.abs(x), kind="stable")[:k])


@pytest.mark.parametrize(("n", "d", "k"), [(4, 300, 17), (6, 1000, 100), (3, 50, 1)])
def test_pairwise_metrics_match_numpy_sets(n, d, k):
    x = _random_grads(n, d, seed=d + k)
    metrics = topk_set_metrics(x, k)
    sets = [_brute_topk(row, k) for row in x.numpy()]
    sets.append(_brute_topk(x.numpy().mean(axis=0), k))
    for i, j in itertools.product(range(n + 1), repeat=2):
        inter = np.intersect1d(sets[i], sets[j]).size
        union = np.union1d(sets[i], sets[j]).size
        xor = np.setxor1d(sets[i], sets[j]).size
        assert int(metrics.intersections[i, j]) == inter
        assert float(metrics.overlap[i, j]) == pytest.approx(inter / k)
        assert float(metrics.jaccard[i, j]) == pytest.approx(inter / union)
        assert int(metrics.hamming[i, j]) == xor
    assert np.array_equal(np.sort(metrics.indices.numpy(), axis=1), np.stack(sets))
    assert metrics.union == reduce(np.union1d, sets[:n]).size
    full = reduce(np.intersect1d, sets[:n]).size
    assert metrics.full_intersection == pytest.approx(full / k)
    counts = np.zeros(d, dtype=np.int64)
    for s in sets[:n]:
        counts[s] += 1
    assert np.array_equal(metrics.histogram.numpy(), np.bincount(counts, minlength=n + 1)[1:])
    _, histogram = set_overlaps(metrics.indices, n)
    assert torch.equal(histogram, metrics.histogram)
    mean = x.numpy().mean(axis=0)
    energy = [np.sum(mean[s] ** 2) / np.sum(mean**2) for s in sets]
    np.testing.assert_allclose(metrics.energy.numpy(), energy, rtol=1e-6)  # float32 norm


@pytest.mark.parametrize("s", [2, 15, 16, 40, 63, 64, 70, 130])  # one, two and three words
def test_set_overlaps_for_many_sets_match_numpy(s):
    d, k, n = 300, 25, s - 1
    rng = np.random.default_rng(s)
    sets = [rng.choice(d, size=k, replace=False) for _ in range(s)]
    inter, histogram = set_overlaps(torch.from_numpy(np.stack(sets)), n)
    want = [[np.intersect1d(a, b).size for b in sets] for a in sets]
    assert np.array_equal(inter.numpy(), want)
    counts = np.zeros(d, dtype=np.int64)
    for held in sets[:n]:
        counts[held] += 1
    assert np.array_equal(histogram.numpy(), np.bincount(counts, minlength=n + 1)[1:])


def test_buildup_curve_is_the_mean_over_all_subsets_and_all_orders():
    n, d, k = 5, 400, 30
    x = _random_grads(n, d, seed=3, shared=0.7)
    idx = topk_indices(x, k)
    curve = buildup_curve(set_overlaps(idx, n)[1], n).numpy()
    sets = [row.numpy() for row in idx]
    by_subsets = [
        np.mean(
            [
                reduce(np.union1d, [sets[i] for i in c]).size
                for c in itertools.combinations(range(n), m)
            ]
        )
        for m in range(1, n + 1)
    ]
    np.testing.assert_allclose(curve, by_subsets, rtol=1e-12)
    prefix_unions = np.array(
        [
            [reduce(np.union1d, [sets[i] for i in order[:m]]).size for m in range(1, n + 1)]
            for order in itertools.permutations(range(n))
        ]
    )
    np.testing.assert_allclose(curve, prefix_unions.mean(axis=0), rtol=1e-12)
    assert curve[0] == pytest.approx(k)
    assert curve[-1] == pytest.approx(reduce(np.union1d, sets).size)


def test_buildup_curve_matches_hypergeometric_reference():
    n, d = 7, 50
    c = np.random.default_rng(1).integers(0, n + 1, size=d)  # multiplicity c(j)
    curve = buildup_curve(torch.from_numpy(np.bincount(c, minlength=n + 1)[1:]), n).numpy()
    expected = [np.sum((c > 0) * (1 - hypergeom(n, c, m).pmf(0))) for m in range(1, n + 1)]
    np.testing.assert_allclose(curve, expected, rtol=1e-10)


def test_identical_learners_overlap_one_and_no_buildup():
    row = _random_grads(1, 500, seed=5)
    x = row.repeat(4, 1)
    metrics = topk_set_metrics(x, 25)
    assert torch.all(metrics.overlap == 1.0)
    assert torch.all(metrics.jaccard == 1.0)
    assert torch.all(metrics.hamming == 0)
    assert metrics.union == 25
    assert metrics.full_intersection == 1.0
    np.testing.assert_allclose(metrics.buildup_curve().numpy() / 25, np.ones(4))
    assert bool(metrics.contraction_ok.all())


def test_disjoint_supports_build_up_to_n():
    n, block, k = 4, 50, 10
    x = torch.zeros(n, n * block)
    rng = np.random.default_rng(2)
    for i in range(n):
        x[i, i * block : (i + 1) * block] = torch.from_numpy(rng.normal(size=block) + 5.0)
    metrics = topk_set_metrics(x, k)
    off_diagonal = ~torch.eye(n + 1, dtype=torch.bool)
    off_diagonal[n, :] = off_diagonal[:, n] = False
    assert torch.all(metrics.intersections[off_diagonal] == 0)
    assert metrics.union == n * k
    assert metrics.full_intersection == 0.0
    np.testing.assert_allclose(metrics.buildup_curve().numpy() / k, np.arange(1, n + 1))


def test_random_baselines_match_simulation():
    d, k, trials, m_max = 200, 20, 4000, 6
    rng = np.random.default_rng(7)
    sets = np.argsort(rng.random((trials, m_max, d)), axis=2)[:, :, :k]
    member = np.zeros((trials, m_max, d), dtype=bool)
    np.put_along_axis(member, sets, True, axis=2)
    covered = np.logical_or.accumulate(member, axis=1).sum(axis=2)  # U(m) per trial
    simulated = covered.mean(axis=0)
    stderr = covered.std(axis=0, ddof=1) / np.sqrt(trials)
    formula = random_union(d, k, torch.arange(1, m_max + 1)).numpy()
    assert np.all(np.abs(simulated - formula) < 4 * stderr + 1e-9)
    inter = (member[:, 0] & member[:, 1]).sum(axis=1) / k
    assert abs(inter.mean() - random_overlap(d, k)) < 4 * inter.std(ddof=1) / np.sqrt(trials)
    assert random_overlap(d, k) == k / d


def test_energy_and_contraction_check_on_a_constructed_case():
    # mean = [10, 1, 0, 0]; I* = {0, 1} holds all the energy.
    g0 = torch.tensor([0.0, 2.0, 5.0, 0.0])  # top-2 {1, 2}: overlap 1/2, E = 1/101
    g1 = torch.tensor([20.0, 0.0, -5.0, 0.0])  # top-2 {0, 2}: overlap 1/2, E = 100/101
    metrics = topk_set_metrics(torch.stack([g0, g1]), 2)
    np.testing.assert_allclose(metrics.energy.numpy(), [1 / 101, 100 / 101, 1.0])
    # needs E(I_l) >= overlap * E(I*): 1/101 < 1/2 breaks; 100/101 >= 1/2 holds
    assert metrics.contraction_ok.tolist() == [False, True]
    ok = contraction_ok(
        torch.tensor([0.3, 0.7]), torch.tensor(0.8), torch.tensor([5, 5]), k=10
    )  # bound 1 - (5/10) * 0.8 = 0.6 on rho = 0.7, 0.3
    assert ok.tolist() == [False, True]
    assert torch.isnan(energy_captured(torch.zeros(4), torch.tensor([[0, 1]])))[0]


def test_energy_is_float64_exact_on_a_long_float32_vector():
    # A float32 norm over 3M values is off by ~1e-7 relative; the float64 one by ~1e-16.
    rng = np.random.default_rng(7)
    x = rng.standard_t(3, size=3_000_000).astype(np.float32)
    indices = np.stack([rng.choice(x.size, 1000, replace=False) for _ in range(2)])
    x64 = x.astype(np.float64)
    expected = (x64[indices] ** 2).sum(axis=1) / np.dot(x64, x64)
    got = energy_captured(torch.from_numpy(x), torch.from_numpy(indices)).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-13)


def test_paired_intersections():
    a = topk_indices(_random_grads(3, 120, seed=11), 15)
    b = topk_indices(_random_grads(3, 120, seed=12), 15)
    got = paired_intersection_sizes(a, b).tolist()
    assert got == [np.intersect1d(a[i].numpy(), b[i].numpy()).size for i in range(3)]
    assert torch.equal(set_overlaps(a, 3)[0].diagonal(), torch.full((3,), 15))


@pytest.mark.parametrize(
    ("d", "k"), [(1 << 16, 1), (1 << 16, 64), (200_003, 12_000), (300_000, 300), (786_437, 2_000)]
)
def test_prefiltered_topk_is_exact_on_long_rows(d, k):
    x = _random_grads(3, d, seed=k).float()
    got = np.sort(topk_indices(x, k).numpy(), axis=1)
    want = np.stack([_brute_topk(row, k) for row in x.numpy()])
    assert np.array_equal(got, want)


def test_prefiltered_topk_falls_back_when_the_sample_misleads():
    # every strided sample position is large, so the sampled threshold keeps only ~1.5k/8
    # candidates: fewer than k, and the row must fall back to a full top-k
    d, k = 1 << 17, 2000
    x = torch.rand(2, d, generator=torch.Generator().manual_seed(0))
    x[:, :: d // (1 << 14)] += 5.0
    x[1] *= -1
    got = np.sort(np.abs(x.gather(1, topk_indices(x, k)).numpy()), axis=1)
    want = np.sort(-np.sort(-np.abs(x.numpy()), axis=1)[:, :k], axis=1)
    assert np.array_equal(got, want)


@pytest.mark.parametrize(("d", "ratio"), [(1 << 20, 0.01), (1 << 22, 1e-4), (1 << 25, 0.001)])
def test_candidates_room_holds_what_survives_the_sampled_threshold(d, ratio):
    """The room a scan reserves holds the candidates, so a row takes one pass (a fixed
    room of 64K overflowed on every 32M-value row at ratio 0.001: 1.5 k + 32 d / 16384
    = 115K candidates)."""
    k = round(ratio * d)
    x = torch.from_numpy(np.random.default_rng(d).standard_normal(d, dtype=np.float32))
    survivors = int((x.abs() >= prefilter_threshold(x, k)).sum())
    assert k <= survivors <= candidates_room(d, k) / 1.5


def test_topk_indices_rejects_bad_k():
    with pytest.raises(ValueError):
        topk_indices(torch.ones(5), 6)
    with pytest.raises(ValueError):
        topk_indices(torch.ones(5), 0)


def test_replay_steps_walks_from_the_first_recorded_step_and_warns_on_gaps():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert replay_steps([3, 4, 5, 6], [5]) == [3, 4, 5]
    with pytest.warns(GradstatWarning, match="gaps up to 10"):
        assert replay_steps([0, 10, 20, 30], [10, 20]) == [0, 10, 20]


@pytest.mark.parametrize(
    ("d", "ks"), [(100, [1, 50, 85]), (200_003, [20_000, 2_000, 1]), (1 << 17, [60_000])]
)
def test_kth_largest_matches_a_full_sort(d, ks):
    # the row's k-th largest |x| from a level sampled for it (long rows) or from all of
    # it (short or dense ones)
    x = torch.from_numpy(np.random.default_rng(d).standard_t(2, size=d).astype(np.float32))
    x[::7] = 0.0  # ties at zero do not matter above them
    expected = np.sort(np.abs(x.numpy()))[::-1]
    passes = RowPasses(x)
    assert [passes.kth_largest(k) for k in ks] == [float(expected[k - 1]) for k in ks]


@pytest.mark.parametrize("d", [0, 5, 300_007])
def test_indices_above_equals_a_mask(d):
    # the compiled pass must pick exactly what torch's mask picks, at thresholds equal
    # to element values (strict vs inclusive)
    x = torch.from_numpy(np.random.default_rng(d).standard_t(3, d).astype(np.float32))
    thresholds = [0.0, 1.5] + ([float(x[d // 2].abs()), float(x.abs().max())] if d else [])
    for t in thresholds:
        for inclusive in (True, False):
            mask = x.abs() >= t if inclusive else x.abs() > t
            got = indices_above(x, t, inclusive)
            assert torch.equal(got, torch.nonzero(mask).view(-1)), (t, inclusive)
