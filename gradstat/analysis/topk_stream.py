"""Top-k sets of one step, streamed one learner's row (or column block) at a time.

Contract: :func:`stream_step_sets` returns, for one step and scope, each learner's top-k
index set (and the mean gradient's, with the energy E(I) of each set: docs/methods.md 3)
without stacking the step's learners. Each row is read (and checked) into the unit's
:class:`SetBuffers` on its reading thread, one row ahead of the scan, moved to the
compute device and scanned once (:func:`gradstat.stats.rows.scan`): checked for NaN/Inf
(a ``DataError`` naming step and learner), added to a compensated float32 running sum
for the mean, and cut to its top-k candidates (:func:`gradstat.stats.topk_sets.top_of`).
The mean is made in the last row's buffer, with its candidates and sum of squares, in
one more pass. Memory: a row, the sum and O(learners x k) for the sets, whatever the
number of learners.

When a row is longer than the memory budget allows (``Compute.block_numel``), the scope
is processed in column blocks. Top-k over blocks is exact: each block keeps its own
top-k candidates until a row has k of them, then only those at least as large as the
k-th largest kept (the row's floor, :class:`_RowCandidates`); the mean's value at each
candidate is taken while its block's mean is at hand.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gradstat.analysis.row_workspace import Workspace, column_blocks
from gradstat.stats.row_kernels import Room
from gradstat.stats.rows import CompensatedSum, Found, require_finite, scan, scan_mean
from gradstat.stats.topk_sets import (
    candidates_room,
    prefilter_threshold,
    prefilters,
    sample_positions,
    top_of,
)
from gradstat.store import Capture, Scope

TOPK = "a top-k set analysis"


class SetBuffers:
    """What a unit reads its steps' rows into: a reader with row (or column block)
    buffers of ``width`` values (:class:`~gradstat.analysis.row_workspace.Workspace`: the
    next row is read and checked on its thread while this one is scanned), the step's
    compensated sum on ``device`` (``with_mean``) and the scans' candidate rooms, kept
    from step to step (a fresh row costs its page faults: docs/large.md); a context
    manager that frees them (and stops the reader) when the unit ends."""

    def __init__(self, width: int, device: torch.device, with_mean: bool) -> None:
        self.device = device
        self.space = Workspace()
        self.space.ensure(width)
        self.sums = CompensatedSum(width, device) if with_mean else None
        self.rooms = [Room(0), Room(0)]  # a learner's row, the mean

    def room(self, which: int, d: int, k: int) -> Room:
        """The ``which``-th candidate room, large enough for a row of ``d``'s top-k
        (:func:`~gradstat.stats.topk_sets.candidates_room`)."""
        if self.rooms[which].size < candidates_room(d, k):
            self.rooms[which] = Room(candidates_room(d, k))
        return self.rooms[which]

    def __enter__(self) -> SetBuffers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.space.release()
        self.sums, self.rooms = None, []


@dataclass
class _Running:
    """A running top-k: |values|, indices (scope-local) and the mean's value at each."""

    magnitudes: torch.Tensor
    indices: torch.Tensor
    mean_values: torch.Tensor | None = None

    def top(self, k: int) -> _Running:
        """The top-k of these candidates (k at most their number)."""
        keep = torch.topk(self.magnitudes, k, sorted=False).indices
        mean_values = None if self.mean_values is None else self.mean_values.index_select(0, keep)
        return _Running(
            self.magnitudes.index_select(0, keep), self.indices.index_select(0, keep), mean_values
        )


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
    buffers: SetBuffers,
    row: tuple[int, int, bool],
    floor: float | None,
) -> _Running:
    """One pass over a learner's block (:func:`~gradstat.stats.rows.scan`):
    finiteness, the running sum and the top-k candidates (|x| >= the row's ``floor``,
    else a sampled t as in ``topk_indices``; all of it when the block is short or dense);
    then the exact top-k of the candidates. ``row``: (step, learner, first learner of the
    step)."""
    d = x.numel()
    k = min(k, d)
    threshold = floor if floor is not None else prefilter_threshold(x, k)
    found = scan(x, threshold, buffers.room(0, d, k), buffers.sums, first=row[2])
    require_finite(row[0], x, [row[1]], TOPK, found.finite)
    return _top(x, k, start, threshold, found, floor)


def _mean_top(
    k: int, start: int, n: int, mean: torch.Tensor, buffers: SetBuffers, floor: float | None
) -> tuple[_Running, float]:
    """The mean of the step's ``n`` rows in this block, from the running sum, into
    ``mean``; its top-k as :func:`_scan_row`'s; and its sum of squares (float64). One
    pass (:func:`~gradstat.stats.rows.scan_mean`): the pre-filter's sample is taken from
    the sum first, the very values the mean will have there."""
    d = mean.numel()
    k = min(k, d)
    total, error = buffers.sums.parts(d)
    threshold = floor
    if threshold is None and prefilters(d, k):
        at = sample_positions(d)
        threshold = prefilter_threshold(mean, k, sample=(total[at] - error[at]).div_(n).abs())
    found, squares = scan_mean(buffers.sums, n, mean, threshold, buffers.room(1, d, k))
    return _top(mean, k, start, threshold, found, floor), squares


def stream_step_sets(
    cap: Capture,
    step: int,
    learners: Sequence[int],
    scope: Scope,
    ks: Sequence[int],
    buffers: SetBuffers,
    block: int,
    then: int | None = None,
) -> list[StepSets]:
    """Top-k sets of every learner (and of the mean when ``buffers`` keep a sum) for each
    k in ``ks``: each learner's row read once into ``buffers`` (in column blocks of
    ``block`` when shorter than the scope); exact, module docstring. The first
    learner's next block, or at the last block the first block of step ``then`` (the
    step likely asked for next in this scope), is read while the mean is made."""
    d, n, kmax = scope.numel, len(learners), max(ks)
    with_mean = buffers.sums is not None
    running = [_RowCandidates(kmax) for _ in range(n + 1)]
    total = torch.zeros((), dtype=torch.float64, device=buffers.device)
    blocks = list(column_blocks(d, min(block, d)))
    for b, (start, stop) in enumerate(blocks):
        ahead = (step, *blocks[b + 1]) if b + 1 < len(blocks) else None
        if ahead is None and then is not None:
            ahead = (then, *blocks[0])
        rows = buffers.space.rows(cap, step, learners, scope, start, stop, ahead)
        candidates, x = [], None
        for i, view in enumerate(rows):  # a row stays valid until the next is handed out
            x = torch.from_numpy(view).to(buffers.device)
            learner = learners[i]
            row = (step, learner, i == 0)
            candidates.append(_scan_row(x, kmax, start, buffers, row, running[i].floor))
        if with_mean:  # the mean goes where the last row was (no longer needed)
            top, squares = _mean_top(kmax, start, n, x, buffers, running[n].floor)
            total += squares
            candidates.append(top)
            for c in candidates:
                c.mean_values = x.index_select(0, c.indices - start).double()
        for i, c in enumerate(candidates):
            running[i].add(c)
    return _step_sets(running, ks, n, d, total if with_mean else None)


def _step_sets(
    running: list[_RowCandidates], ks: Sequence[int], n: int, d: int, total: torch.Tensor | None
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
