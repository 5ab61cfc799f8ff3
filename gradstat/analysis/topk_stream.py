"""Top-k sets of one step, streamed one learner's row (or column block) at a time.

Contract: :func:`stream_step_sets` returns, for one step and scope, each learner's top-k
index set (and the mean gradient's, with the energy E(I) of each set: docs/methods.md
3) without stacking the step's learners. Each row is read (and checked) through the
unit's :class:`~gradstat.analysis.row_workspace.Workspace`, moved to the compute device
and scanned once (:func:`gradstat.stats.rows.scan`): checked for NaN/Inf (a
``DataError`` naming step and learner), added to a compensated float32 running sum for
the mean, and cut to its top-k candidates (:func:`gradstat.stats.topk_sets.top_of`). On
the CPU two rows are scanned in one pass (:func:`~gradstat.stats.row_kernels.
scan_row_pair`: the sum read and written once for both, the same numbers), and a step's
last pair makes the mean. Memory: a few rows, the sum and O(learners x k) for the sets,
whatever the number of learners.

When a row is longer than the memory budget allows (``Compute.block_numel``), the scope
is processed in column blocks. Top-k over blocks is exact: each block keeps its own
top-k candidates until a row has k of them, then only those at least as large as the
k-th largest kept (the row's floor, :class:`_RowCandidates`); the mean's value at each
candidate is taken while its block's mean is at hand.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gradstat.analysis.row_workspace import Workspace, column_blocks
from gradstat.stats.row_kernels import MeanOf, scan_row_pair
from gradstat.stats.row_plain import compensated_add
from gradstat.stats.rows import Found, require_finite, scan, scan_mean
from gradstat.stats.topk_sets import prefilter_threshold, prefilters, sample_positions, top_of
from gradstat.store import Capture, Scope

TOPK = "a top-k set analysis"


@dataclass
class _Running:
    """A running top-k: |values|, indices (scope-local) and the mean's value at each."""

    magnitudes: torch.Tensor
    indices: torch.Tensor
    mean_values: torch.Tensor | None = None

    def top(self, k: int) -> _Running:
        """The top-k of these candidates (k at most their number)."""
        keep = torch.topk(self.magnitudes, k, sorted=False).indices
        mean_values = None if self.mean_values is None else self.mean_values[keep]
        return _Running(self.magnitudes[keep], self.indices[keep], mean_values)


class _RowCandidates:
    """A row's top-k candidates, gathered block by block, and its floor: once at least
    k are kept, the k-th largest |value| among them. The row's k-th largest is at least
    that, so a value below the floor cannot be in its top-k, and later blocks are scanned
    at the floor (|x| >= floor: ties kept) instead of a threshold sampled from the block
    for a top-k of its own (a block of B values holds about k B / d of the row's top-k;
    its own top-k kept k). Candidates are cut to the top k once twice k have gathered,
    which raises the floor. A floor of 0 (fewer than k non-zeros so far) is no floor:
    every value would pass it."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.parts: list[_Running] = []
        self.count = 0
        self.floor: float | None = None

    def add(self, part: _Running) -> None:
        """Keep a block's candidates; cut to the top k, raising the floor, once twice k
        have gathered."""
        self.parts.append(part)
        self.count += part.indices.numel()
        if self.count >= 2 * self.k:
            kept = self.joined().top(self.k)
            self.parts, self.count = [kept], self.k
            self.floor = float(kept.magnitudes.min()) or None

    def joined(self) -> _Running:
        """Every candidate kept, as one :class:`_Running`."""
        if len(self.parts) == 1:
            return self.parts[0]
        mean_values = None
        if all(p.mean_values is not None for p in self.parts):
            mean_values = torch.cat([p.mean_values for p in self.parts])
        return _Running(
            torch.cat([p.magnitudes for p in self.parts]),
            torch.cat([p.indices for p in self.parts]),
            mean_values,
        )


@dataclass(frozen=True)
class StepSets:
    """Top-k sets of one step and scope at one k.

    ``indices``: ``[n + 1, k]`` (learners, then the mean gradient when it was computed,
    else ``[n, k]``); ``energy``: E(I) of the mean gradient for each row (float64, or None);
    ``sparse``: whether some learner's vector has fewer than k non-zeros (its set is then
    partly arbitrary ties).
    """

    k: int
    d: int
    indices: torch.Tensor
    energy: torch.Tensor | None
    sparse: bool


def _threshold(x: torch.Tensor, k: int, floor: float | None) -> float | None:
    """A block's candidate threshold: the row's floor (:class:`_RowCandidates`), else
    one sampled from the block (``prefilter_threshold``; None: no pre-filter)."""
    return floor if floor is not None else prefilter_threshold(x, k)


def _top(
    x: torch.Tensor, k: int, start: int, threshold: float | None, found: Found, floor: float | None
) -> _Running:
    """The exact top-k of a block from the candidates its scan found at ``threshold``
    (:func:`~gradstat.stats.topk_sets.top_of`; none found without one): at the row's
    ``floor`` (:class:`_RowCandidates`) fewer than k are every value of the block that
    can still count; at a sampled threshold they mean the sample misled."""
    candidates = None if threshold is None else found.indices
    indices, magnitudes = top_of(x, k, candidates, found.magnitudes, complete=floor is not None)
    return _Running(magnitudes.clone(), indices + start)


def _scan_row(
    x: torch.Tensor,
    k: int,
    start: int,
    space: Workspace,
    row: tuple[int, int, bool],
    floor: float | None = None,
) -> _Running:
    """One pass over a learner's block (:func:`~gradstat.stats.rows.scan`):
    finiteness, the running sum and the top-k candidates (|x| >= the row's ``floor``,
    else a sampled t as in ``topk_indices``; all of it when the block is short or dense);
    then the exact top-k of the candidates. ``row``: (step, learner, first learner of the
    step)."""
    d = x.numel()
    k = min(k, d)
    threshold = _threshold(x, k, floor)
    room = space.candidate_room(0, d, k)
    found = scan(x, threshold, room, space.sums, first=row[2])
    require_finite(row[0], x, [row[1]], TOPK, found.finite)
    return _top(x, k, start, threshold, found, floor)


def _scan_pair(
    rows: tuple[tuple[torch.Tensor, tuple[int, int, bool]], ...],
    k: int,
    start: int,
    space: Workspace,
    mean_of: int | None = None,
    floors: tuple[float | None, float | None, float | None] = (None, None, None),
) -> tuple[list[_Running], tuple[_Running, float] | None]:
    """:func:`_scan_row` of two recorded rows of a step, in order, on the CPU in one pass
    (:func:`~gradstat.stats.row_kernels.scan_row_pair`): the running sum is read and
    written once for both (made by them when the first is the step's first); the same
    sum and candidates as two scans. ``mean_of``: the step's learner count when these are
    its last two rows; the pass then leaves the mean in the sum's row
    (:class:`~gradstat.stats.row_kernels.MeanOf`) and also returns its top-k and its sum
    of squares."""
    (a, a_row), (b, b_row) = rows
    d = a.numel()
    k = min(k, d)
    thresholds = _threshold(a, k, floors[0]), _threshold(b, k, floors[1])
    rooms = space.candidate_room(0, d, k), space.candidate_room(1, d, k)
    total, error = space.sums.parts(d)
    first = a_row[2]
    mean = None
    if mean_of is not None:
        threshold = floors[2]
        if threshold is None and prefilters(d, k):  # the mean's sample, from the pass's ops
            at = sample_positions(d)
            sample = pair_mean(a[at], b[at], total[at], error[at], first, mean_of).abs()
            threshold = prefilter_threshold(total, k, sample=sample)
        mean = MeanOf(mean_of, threshold, space.candidate_room(2, d, k))
    arrays = (a.numpy(), b.numpy())
    found = scan_row_pair(arrays, thresholds, rooms, total.numpy(), error.numpy(), first, mean)
    made = None
    if mean is not None and found.mean is not None:
        indices, magnitudes, squares = found.mean
        candidates = Found(torch.from_numpy(indices), torch.from_numpy(magnitudes), True)
        made = _top(total, k, start, mean.threshold, candidates, floors[2]), squares
    tops = []
    for x, row, threshold, one, floor in zip(
        (a, b), (a_row, b_row), thresholds, (found.a, found.b), floors[:2], strict=True
    ):
        require_finite(row[0], x, [row[1]], TOPK, one.finite)
        candidates = Found(torch.from_numpy(one.indices), torch.from_numpy(one.magnitudes), True)
        tops.append(_top(x, k, start, threshold, candidates, floor))
    return tops, made


def pair_mean(
    a: torch.Tensor, b: torch.Tensor, s: torch.Tensor, c: torch.Tensor, first: bool, n: int
) -> torch.Tensor:
    """The mean a step's last pair leaves (:func:`~gradstat.stats.row_kernels.scan_row_pair`)
    at a few positions: a then b added to the compensated sum ``s``, ``c`` (or making it,
    when ``first``; :func:`~gradstat.stats.row_plain.compensated_add`), then
    ``(s - c) / n``; float32, the same operations in the same order, so the same bits:
    the mean's pre-filter sample, taken before the pass that makes the mean."""
    s, c = (a, torch.zeros_like(a)) if first else compensated_add(s, c, a)
    s, c = compensated_add(s, c, b)
    return (s - c).div_(n)


def _mean_top(
    k: int, start: int, n: int, mean: torch.Tensor, space: Workspace, floor: float | None = None
) -> tuple[_Running, float]:
    """The mean of the step's ``n`` rows in this block, from the running sum, into
    ``mean``; its top-k as :func:`_scan_row`'s; and its sum of squares (float64). One
    pass (:func:`~gradstat.stats.rows.scan_mean`): the pre-filter's sample is taken from
    the sum first, the very values the mean will have there."""
    d = mean.numel()
    k = min(k, d)
    total, error = space.sums.parts(d)
    threshold = floor
    if threshold is None and prefilters(d, k):
        at = sample_positions(d)
        threshold = prefilter_threshold(mean, k, sample=(total[at] - error[at]).div_(n).abs())
    found, squares = scan_mean(space.sums, n, mean, threshold, space.candidate_room(0, d, k))
    return _top(mean, k, start, threshold, found, floor), squares


def stream_step_sets(
    cap: Capture,
    step: int,
    learners: Sequence[int],
    scope: Scope,
    ks: Sequence[int],
    *,
    with_mean: bool,
    device: torch.device,
    block: int,
    workspace: Workspace | None = None,
    then: int | None = None,
) -> list[StepSets]:
    """Top-k sets of every learner (and of the mean when ``with_mean``) for each k in ``ks``.

    Reads each learner's row once (in column blocks of ``block`` when shorter than the
    scope); exact, module docstring. ``workspace``: the caller's unit's buffers, kept
    from call to call (default: buffers of this call alone); ``then``: the step likely
    asked for next, whose first row (first block) is read ahead; the first learner's
    next block is read ahead the same way.
    """
    if workspace is None:
        with Workspace() as space:
            return stream_step_sets(
                cap,
                step,
                learners,
                scope,
                ks,
                with_mean=with_mean,
                device=device,
                block=block,
                workspace=space,
            )
    d, n, kmax = scope.numel, len(learners), max(ks)
    block = min(block, d)
    space = workspace
    space.ensure(block, device, with_mean)
    running = [_RowCandidates(kmax) for _ in range(n + 1)]
    total = torch.zeros((), dtype=torch.float64, device=device)
    blocks = list(column_blocks(d, block))
    for b, (start, stop) in enumerate(blocks):
        if b + 1 < len(blocks):
            ahead = (step, *blocks[b + 1])
        else:
            ahead = None if then is None else (then, *blocks[0])
        rows = space.rows(cap, step, learners, scope, start, stop, ahead)
        candidates, last, made = _scan_block(
            rows, step, learners, start, kmax, space, running, with_mean, device
        )
        if with_mean:  # the mean goes where the last row was (no longer needed)
            if made is None:
                made = _mean_top(kmax, start, n, last, space, running[n].floor)
                mean = last
            else:
                mean = space.sums.total[: stop - start]
            top, squares = made
            total += squares
            candidates.append(top)
            for c in candidates:
                c.mean_values = mean[c.indices - start].double()
        for i, c in enumerate(candidates):
            running[i].add(c)
    return _step_sets(running, ks, n, d, total if with_mean else None)


def _scan_block(
    rows: Iterator[np.ndarray],
    step: int,
    learners: Sequence[int],
    start: int,
    kmax: int,
    space: Workspace,
    running: list[_RowCandidates],
    with_mean: bool,
    device: torch.device,
) -> tuple[list[_Running], torch.Tensor, Any]:
    """Each learner's top-k candidates of one block (scanned in pairs where
    ``space.pairs``), the last row as a tensor, and the mean's ``(top, squares)`` when
    the step's last pair made it (else None)."""
    n = len(learners)
    candidates: list[_Running] = []
    held = made = x = None  # held: a pair's first row, until its second comes
    for i, (learner, view) in enumerate(zip(learners, rows, strict=True)):
        x = torch.from_numpy(view).to(device)
        row = (step, learner, i == 0)
        if not space.pairs:
            candidates.append(_scan_row(x, kmax, start, space, row, running[i].floor))
        elif held is None:
            held = (x, row)
        else:
            mean_of = n if with_mean and i == n - 1 else None
            floors = (running[i - 1].floor, running[i].floor, running[n].floor)
            tops, made = _scan_pair((held, (x, row)), kmax, start, space, mean_of, floors)
            candidates.extend(tops)
            held = None
    if held is not None:
        floor = running[n - 1].floor
        candidates.append(_scan_row(held[0], kmax, start, space, held[1], floor))
    return candidates, x, made


def _step_sets(
    running: list[_RowCandidates], ks: Sequence[int], n: int, d: int, total: Any
) -> list[StepSets]:
    """The :class:`StepSets` of each k from the rows' joined candidates (the mean's
    last, with the energies, where ``total`` is its sum of squares)."""
    rows = [r.joined() for r in running[: n if total is None else n + 1]]
    out = []
    for k in ks:
        tops = [r.top(k) for r in rows]
        indices = torch.stack([t.indices for t in tops])
        sparse = bool(torch.stack([t.magnitudes.min() for t in tops[:n]]).eq(0).any())
        energy = None
        if total is not None:
            energy = torch.stack([t.mean_values.square().sum() for t in tops]) / total
        out.append(StepSets(k, d, indices, energy, sparse))
    return out
