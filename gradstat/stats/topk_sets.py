"""Top-k index sets of learners' gradients and the cross-learner metrics of docs/methods.md 3.

Top-k selection is O(d) per row; everything after it works on the index sets alone
(sorting the n k indices, owner bit masks per distinct index, ``torch.isin``), so its
memory is O(n k) whatever d; no Python sets and no d-length masks. Notation: ``n`` learners,
``d`` elements in the scope, ``k`` elements kept, ``I_i`` = top-k(|g_i|), ``I*`` =
top-k(|mean_i g_i|) (ScaleCom, Chen et al. 2021, arXiv 2104.11125).

* Overlap O(A, B) = |A n B| / k, Hamming |A xor B| = 2 (k - |A n B|), Jaccard
  |A n B| / |A u B| = |A n B| / (2k - |A n B|); random baseline overlap k / d.
* Multiplicity c(j) = number of learners whose set holds j, h(c) = #{j: c(j) = c}; union
  U = sum_c h(c); build-up factor B = U / k in [1, n]; full intersection h(n) / k.
* Build-up curve B(m), m = 1..n, averaged exactly over every learner order: a random
  order's first m learners are a uniformly random m-subset, and index j (held by c(j)
  learners) is missed by it with the hypergeometric probability C(n - c, m) / C(n, m), so
  E[U(m)] = sum_c h(c) (1 - C(n - c, m) / C(n, m)) with h the histogram of c(j).
  Random baseline (independent uniform k-subsets): E[U(m)] = d (1 - (1 - k/d)^m).
* Energy captured E(I) = ||xbar_I||^2 / ||xbar||^2 of the mean gradient xbar; contraction
  rho = 1 - E(I). ScaleCom's CLT-k needs rho(I_leader) <= d_H/k + (1 - d_H/k) rho(I*) with
  d_H = k - |I_leader n I*|.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from gradstat.stats.row_kernels import indices_at_least

#: Slack for the contraction check: both sides are float sums of the same squares.
CONTRACTION_RTOL = 1e-6
#: ``topk_indices`` pre-filters rows at least this long, at densities k/d up to 1/16,
#: with a strided sample of about this many elements, a chunk of the row at a time.
PREFILTER_MIN_NUMEL = 1 << 16
PREFILTER_MAX_DENSITY_INV = 16
PREFILTER_SAMPLE = 1 << 14
#: Elements per chunk of the candidate pass: large enough for torch to spread each op over
#: its threads (2 MiB of float32, still cache-sized).
PREFILTER_CHUNK = 1 << 19
#: Sets per word of the owner bit masks of ``set_overlaps`` (int64, sign bit unused).
OWNER_BITS = 63


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (int64, unsorted) of the ``k`` largest ``|x|`` along the last dimension.

    Exact: the same set as ``torch.topk(x.abs(), k)`` (ties broken either way). Long rows
    are first cut to candidates ``|x| >= t``, with ``t`` an upper quantile of a strided
    sample chosen so that about 1.5 k (plus a margin) survive (:func:`prefilter_threshold`),
    as DGC's sampled threshold does (Lin et al. 2018; docs/methods.md 2); the top k of
    the candidates follow (:func:`top_of`), or when fewer than k survive, of all of the
    row, so the result never depends on the sample.
    """
    d = x.shape[-1]
    if not 0 < k <= d:
        raise ValueError(f"k={k} must be in 1..{d}")
    rows = x.reshape(-1, d)
    out = torch.empty(rows.shape[0], k, dtype=torch.int64, device=x.device)
    for i, row in enumerate(rows):
        threshold = prefilter_threshold(row, k)
        candidates = None if threshold is None else indices_above(row, threshold)
        out[i] = top_of(row, k, candidates)[0]
    return out.reshape(*x.shape[:-1], k)


def top_of(
    row: torch.Tensor,
    k: int,
    candidates: torch.Tensor | None = None,
    magnitudes: torch.Tensor | None = None,
    complete: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k of a flat row as (indices, |row| at each), gradstat's one top-k
    selection, from the row's candidates ``|row| >= t`` (indices; ``magnitudes``: their
    |row| when a scan kept them): the top k of the candidates when more than k pass,
    all of them when at most k do and they are ``complete`` (no other value can be in
    the top k: a row's floor) or exactly k do; otherwise (fewer than k passed a sampled
    t, or no candidates) the top k of the whole row. (Gathers by ``index_select``: on
    the CPU ``row[indices]`` of a long row took 20x as long.)"""
    n = -1 if candidates is None else candidates.numel()
    if n < k and not (complete and candidates is not None):
        indices = torch.topk(row.abs(), k, sorted=False).indices
        return indices, row.index_select(0, indices).abs()
    if magnitudes is None:
        magnitudes = row.index_select(0, candidates).abs()
    if n <= k:
        return candidates, magnitudes
    keep = torch.topk(magnitudes, k, sorted=False).indices
    return candidates.index_select(0, keep), magnitudes.index_select(0, keep)


def prefilter_threshold(
    row: torch.Tensor, k: int, sample: torch.Tensor | None = None
) -> float | None:
    """The pre-filter threshold of :func:`topk_indices` for a flat row: the
    ``ceil(1.5 k s / d) + 32``-th largest of ``s`` strided samples of ``|row|`` (``sample``:
    those |values| when the caller has them, :func:`sample_positions`); None when the row is
    short or dense and is not pre-filtered."""
    d = row.numel()
    if not prefilters(d, k):
        return None
    if sample is None:
        sample = row[sample_positions(d)].abs()
    rank = min(sample.numel(), math.ceil(1.5 * k * sample.numel() / d) + 32)
    return float(torch.topk(sample, rank, sorted=False).values.amin())


def candidates_room(d: int, k: int) -> int:
    """Room for the candidates of a top-``k`` pre-filter of a row of ``d``, so that a
    second pass is rare: about ``1.5 k + 32 d / PREFILTER_SAMPLE`` survive the sampled
    threshold (:func:`prefilter_threshold`; 3.5 k at k/d = 0.1%), twice that here."""
    return 3 * k + 64 * (d // PREFILTER_SAMPLE) + 4096


def prefilters(d: int, k: int) -> bool:
    """Whether :func:`topk_indices` pre-filters a row of ``d`` for its top-``k``: rows at
    least ``PREFILTER_MIN_NUMEL`` long, at densities k/d up to 1/``PREFILTER_MAX_DENSITY_INV``."""
    return d >= PREFILTER_MIN_NUMEL and k * PREFILTER_MAX_DENSITY_INV <= d


def sample_positions(d: int) -> slice:
    """The strided positions :func:`prefilter_threshold` samples in a row of ``d``."""
    return slice(None, None, d // PREFILTER_SAMPLE)


def indices_above(row: torch.Tensor, threshold: float, inclusive: bool = True) -> torch.Tensor:
    """Indices (int64, ascending) of ``|row| >= threshold`` (``>`` unless ``inclusive``)
    in a flat row: on the CPU one compiled pass
    (:func:`~gradstat.stats.row_kernels.indices_at_least`), on a GPU torch's ops chunk by
    chunk so that |x| and the mask stay small."""
    if row.device.type == "cpu":
        values = np.ascontiguousarray(row.detach().numpy())
        if values.dtype == np.float32:
            return torch.from_numpy(indices_at_least(values, threshold, inclusive))
        magnitudes = np.abs(values)
        above = magnitudes >= threshold if inclusive else magnitudes > threshold
        return torch.from_numpy(np.flatnonzero(above))
    return torch.cat(
        [
            torch.nonzero(part.abs() >= threshold if inclusive else part.abs() > threshold)
            .squeeze(1)
            .add_(start)
            for start, part in zip(
                range(0, row.numel(), PREFILTER_CHUNK), row.split(PREFILTER_CHUNK), strict=True
            )
        ]
    )


def set_overlaps(indices: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairwise intersections of the sets ``indices [s, k]`` and the multiplicity histogram.

    Returns ``(inter, hist)``: ``inter[a, b] = |I_a n I_b|`` (int64 ``[s, s]``) and h(c)
    for c = 1..n (int64 ``[n]``): how many indices are held by exactly c of the first
    ``n`` sets (union U = sum h, full intersection = h(n)).

    From the index sets alone, in O(s k log(s k)) time and O(s k) memory whatever the
    vector length: the s k indices are sorted, each run of equal indices is one distinct
    index, and its holders become an owner bit mask (63 sets per int64 word). Indices
    with the same owner mask form a group of ``count`` indices; then
    ``inter = B^T diag(count) B`` for the groups' owner bits ``B``, and c(j) is the
    popcount of the first ``n`` bits.
    """
    s, k = indices.shape
    device = indices.device
    flat = indices.reshape(-1)
    order = torch.argsort(flat)
    labels = torch.arange(s, device=device).repeat_interleave(k)[order]
    ordered = flat[order]
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[1:] = ordered[1:] != ordered[:-1]
    run = torch.cumsum(starts, 0) - 1  # which distinct index each position holds
    distinct = int(run[-1]) + 1
    words = -(-s // OWNER_BITS)
    masks = torch.zeros(distinct, words, dtype=torch.int64, device=device)
    bits = torch.ones(1, dtype=torch.int64, device=device) << (labels % OWNER_BITS)
    # a set holds an index once, so adding its bit is OR-ing it in
    masks.index_put_((run, labels // OWNER_BITS), bits, accumulate=True)
    if words == 1:  # one word per index: the much faster 1-d unique
        groups, counts = torch.unique(masks[:, 0], return_counts=True)
        groups = groups[:, None]
    else:
        groups, counts = torch.unique(masks, dim=0, return_counts=True)
    inter = torch.zeros(s, s, dtype=torch.float64, device=device)
    hist = torch.zeros(n + 1, dtype=torch.float64, device=device)
    word = torch.arange(s, device=device) // OWNER_BITS
    shift = torch.arange(s, device=device) % OWNER_BITS
    for chunk, weight in zip(groups.split(1 << 16), counts.split(1 << 16), strict=True):
        owner = ((chunk[:, word] >> shift) & 1).double()  # [groups, s]
        inter += (owner * weight[:, None]).T @ owner
        hist += torch.bincount(owner[:, :n].sum(dim=1).long(), weight.double(), n + 1)
    return inter.round().long(), hist[1:].round().long()


def paired_intersection_sizes(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``|A_i n B_i|`` for each row ``i`` of two index tensors ``[sets, k]`` (int64 ``[sets]``).

    E.g. the same learner's top-k sets at two steps (temporal stability); sort-based
    (``torch.isin``), O(k log k) per pair whatever the vector length.
    """
    return torch.stack(
        [torch.isin(row_b, row_a).sum(dtype=torch.int64) for row_a, row_b in zip(a, b, strict=True)]
    )


def overlap(intersection: torch.Tensor, k: int) -> torch.Tensor:
    """O(A, B) = |A n B| / k."""
    return intersection.double() / k


def hamming(intersection: torch.Tensor, k: int) -> torch.Tensor:
    """|A xor B| = 2 (k - |A n B|) for two k-sets."""
    return 2 * (k - intersection)


def jaccard(intersection: torch.Tensor, k: int) -> torch.Tensor:
    """|A n B| / |A u B| = |A n B| / (2k - |A n B|) for two k-sets."""
    inter = intersection.double()
    return inter / (2 * k - inter)


def buildup_curve(hist: torch.Tensor, n: int) -> torch.Tensor:
    """E[U(m)] for m = 1..n, exactly averaged over all learner orders (float64 ``[n]``).

    ``hist`` is h(c), c = 1..n (``set_overlaps``) over ``n`` learners. Uses the
    hypergeometric miss probability C(n - c, m) / C(n, m) (module docstring); ``E[U(n)]``
    is the union.
    """
    hist = hist.double()
    c = torch.arange(1, n + 1, dtype=torch.float64, device=hist.device)[None, :]
    i = torch.arange(n, dtype=torch.float64, device=hist.device)[:, None]
    # C(n - c, m) / C(n, m) = prod_{i < m} (n - c - i) / (n - i): a running product over m,
    # zero once fewer than m learners lack the index
    miss = ((n - c - i) / (n - i)).clamp(min=0.0).cumprod(dim=0)
    return ((1.0 - miss) * hist).sum(dim=1)


def random_union(d: int, k: int, m: torch.Tensor | int) -> torch.Tensor:
    """E[U(m)] = d (1 - (1 - k/d)^m) for m independent uniformly random k-subsets of d."""
    m = torch.as_tensor(m, dtype=torch.float64)
    return d * (1.0 - (1.0 - k / d) ** m)


def random_overlap(d: int, k: int) -> float:
    """E[|A n B|] / k = k / d for two independent uniformly random k-subsets of d."""
    return k / d


def energy_captured(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """E(I) = ||x_I||^2 / ||x||^2 of one vector ``x [d]`` for each row of ``indices [s, k]``.

    NaN when ``x`` is all zeros.
    """
    # accumulated in float64 chunk by chunk: no float64 copy of x, no float32 rounding
    total = sum(torch.linalg.vector_norm(c, dtype=torch.float64).square() for c in x.split(1 << 20))
    chosen = x.index_select(0, indices.reshape(-1)).reshape(indices.shape)
    return chosen.double().square().sum(dim=-1) / total


def contraction_ok(
    energy_leader: torch.Tensor, energy_topk: torch.Tensor, inter_topk: torch.Tensor, k: int
) -> torch.Tensor:
    """ScaleCom's condition rho_CLT <= d_H/k + (1 - d_H/k) rho_topk (docs/methods.md 3).

    ``energy_leader``: E(I_leader) per candidate leader; ``energy_topk``: E(I*);
    ``inter_topk``: |I_leader n I*|. rho = 1 - E, d_H = k - |I_leader n I*|.
    """
    rho_clt = 1.0 - energy_leader
    rho_topk = 1.0 - energy_topk
    frac = (k - inter_topk).double() / k
    bound = frac + (1.0 - frac) * rho_topk
    return rho_clt <= bound + CONTRACTION_RTOL


@dataclass(frozen=True)
class TopkSetMetrics:
    """All set metrics of one step: ``n`` learners' top-k sets and the mean's (row ``n``).

    ``intersections`` is ``[n + 1, n + 1]`` over the learners then the mean gradient;
    ``histogram`` is h(c), c = 1..n, over the learners' sets; ``energy`` is E(I) of the
    mean gradient for each of the ``n + 1`` sets.
    """

    k: int
    d: int
    indices: torch.Tensor
    intersections: torch.Tensor
    histogram: torch.Tensor
    energy: torch.Tensor

    @property
    def n(self) -> int:
        return self.indices.shape[0] - 1

    @property
    def overlap(self) -> torch.Tensor:
        return overlap(self.intersections, self.k)

    @property
    def jaccard(self) -> torch.Tensor:
        return jaccard(self.intersections, self.k)

    @property
    def hamming(self) -> torch.Tensor:
        return hamming(self.intersections, self.k)

    @property
    def union(self) -> int:
        return int(self.histogram.sum())

    @property
    def full_intersection(self) -> float:
        """|n_i I_i| / k."""
        return int(self.histogram[-1]) / self.k

    @property
    def contraction_ok(self) -> torch.Tensor:
        """ScaleCom's condition with each learner as the CLT-k leader (bool ``[n]``)."""
        n = self.n
        return contraction_ok(self.energy[:n], self.energy[n], self.intersections[:n, n], self.k)

    def buildup_curve(self) -> torch.Tensor:
        """E[U(m)] for m = 1..n, over all learner orders."""
        return buildup_curve(self.histogram, self.n)


def topk_set_metrics(x: torch.Tensor, k: int) -> TopkSetMetrics:
    """Top-k sets of the rows of ``x [n, d]`` and of their mean, and their set metrics."""
    n, d = x.shape
    mean = x.mean(dim=0)
    indices = torch.cat([topk_indices(x, k), topk_indices(mean, k)[None]])
    intersections, histogram = set_overlaps(indices, n)
    return TopkSetMetrics(
        k=k,
        d=d,
        indices=indices,
        intersections=intersections,
        histogram=histogram,
        energy=energy_captured(mean, indices),
    )
