"""Top-k sets of one step, streamed one learner's row (or column block) at a time.

The top-k set analyses never stack a step's learners: each learner's row is read into
one of a few reused buffers (a reading thread fills another with the next row
meanwhile), moved to the compute device and scanned once (on the CPU in one fused loop,
:mod:`gradstat.stats.row_kernels`): checked for NaN/Inf,
added to a compensated float32 running sum (Kahan; the mean gradient, as accurate as a
float64 sum) and cut to its top-k candidates. On the CPU a step's rows are scanned in
pairs, so that the sum is read and written once for two rows (the same updates in the
same order). Memory is the row buffers (four on the CPU, where rows are
read two ahead for the pairs; two on a GPU), the sum and its compensation, and
O(learners x k) for the index sets, whatever the number of learners.

When a row of the scope is longer than the memory budget allows
(``Compute.block_numel``), the scope is processed in column blocks: every learner's
block, then the next block. Top-k over blocks is exact: each block keeps its own top-k
candidates (any index of the global top-k is in its block's top-k), and a running top-k
of the merged candidates is carried from block to block. The mean's value at each
candidate is taken while its block's mean is at hand, so the energy E(I) of the final
sets needs no second pass (docs/methods.md 3).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gradstat.errors import DataError
from gradstat.stats.row_kernels import MeanOf, Room, mean_row, scan_row, scan_row_pair
from gradstat.stats.topk_sets import (
    candidates_room,
    indices_above,
    prefilter_threshold,
    prefilters,
    sample_positions,
    top_of_candidates,
)
from gradstat.store import Capture, Scope

#: Elements per chunk of a pass over a row with torch's ops (on a GPU; the mean's sum of
#: squares): 1 MiB of float32, |x|, the mask and the compensated sum's temporaries stay in
#: cache.
CHUNK = 1 << 18


@dataclass
class _Running:
    """A running top-k: |values|, indices (scope-local) and the mean's value at each."""

    magnitudes: torch.Tensor
    indices: torch.Tensor
    mean_values: torch.Tensor | None = None

    def merge(self, other: _Running, k: int) -> _Running:
        magnitudes = torch.cat([self.magnitudes, other.magnitudes])
        if magnitudes.numel() <= k:
            keep = torch.arange(magnitudes.numel(), device=magnitudes.device)
        else:
            keep = torch.topk(magnitudes, k, sorted=False).indices
        mean_values = None
        if self.mean_values is not None and other.mean_values is not None:
            mean_values = torch.cat([self.mean_values, other.mean_values])[keep]
        return _Running(
            magnitudes[keep], torch.cat([self.indices, other.indices])[keep], mean_values
        )

    def top(self, k: int) -> _Running:
        """The top-k of these candidates (k at most their number)."""
        keep = torch.topk(self.magnitudes, k, sorted=False).indices
        mean_values = None if self.mean_values is None else self.mean_values[keep]
        return _Running(self.magnitudes[keep], self.indices[keep], mean_values)


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


def column_blocks(numel: int, block: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of consecutive blocks of at most ``block`` columns."""
    for start in range(0, numel, block):
        yield start, min(numel, start + block)


def scope_pieces(scope: Scope, start: int, stop: int) -> Iterator[tuple[int, int, int]]:
    """Scope-local columns ``[start, stop)`` as ``(flat start, flat stop, local start)``."""
    local = 0
    for offset, numel in scope.slices:
        lo, hi = max(start, local), min(stop, local + numel)
        if lo < hi:
            yield offset + lo - local, offset + hi - local, lo
        local += numel


def read_block(
    cap: Capture, step: int, learner: int, scope: Scope, start: int, stop: int, out: np.ndarray
) -> np.ndarray:
    """The scope-local columns ``[start, stop)`` of one learner's row, into ``out``."""
    view = out[: stop - start]
    for flat_start, flat_stop, local in scope_pieces(scope, start, stop):
        piece = view[local - start : local - start + flat_stop - flat_start]
        cap.read_row(step, learner, out=piece, columns=slice(flat_start, flat_stop))
    return view


def _then(
    after: Callable[[np.ndarray], Any], row_of: Callable[..., np.ndarray], *args: Any
) -> tuple[np.ndarray, Any]:
    """The row ``row_of(*args)`` gives (:func:`read_block`, or a read ahead's
    ``Future.result``: done, queued first on the same thread), and ``after`` of it."""
    row = row_of(*args)
    return row, after(row)


class _CompensatedSum:
    """A running sum of float32 rows in float32 with Kahan's compensation (Kahan 1965):
    y = x - c, t = s + y, c = (t - s) - y, s = t. Its error stays about 2 eps sum |x_i|
    whatever the number of rows, as a float64 sum would, at float32's memory and speed
    (a float64 accumulator needs a slow mixed-type add). The sum is s - c. Kept for the
    steps of a unit: the first row of a step is copied in, not added to zeros."""

    def __init__(self, width: int, device: torch.device) -> None:
        self.total = torch.empty(width, dtype=torch.float32, device=device)
        self.error = torch.empty(width, dtype=torch.float32, device=device)
        chunk = min(width, CHUNK)
        self._y = torch.empty(chunk, dtype=torch.float32, device=device)
        self._t = torch.empty(chunk, dtype=torch.float32, device=device)

    def add(self, start: int, x: torch.Tensor, first: bool) -> None:
        """Add ``x`` (at most ``CHUNK`` values) to columns ``start:start + len(x)``;
        ``first``: the step's first row (the sum becomes ``x``). On a GPU; on the CPU the
        fused loop of :func:`~gradstat.stats.row_kernels.scan_row` adds rows."""
        s = self.total[start : start + x.numel()]
        c = self.error[start : start + x.numel()]
        if first:
            s.copy_(x)
            c.zero_()
            return
        y, t = self._y[: x.numel()], self._t[: x.numel()]
        torch.sub(x, c, out=y)
        torch.add(s, y, out=t)
        torch.sub(t, s, out=c)
        c.sub_(y)
        s.copy_(t)

    def mean(self, n: int, *, out: torch.Tensor) -> torch.Tensor:
        """(s - c) / n of the first ``len(out)`` columns into ``out``."""
        width = out.numel()
        torch.sub(self.total[:width], self.error[:width], out=out)
        return out.div_(n)


class Workspace:
    """The buffers of a walk over steps, allocated once: the row (or column block)
    buffers, the running mean's sum and the candidate pass's temporaries; and a reading
    thread that fills a buffer with the next learner's row while the rows before it are
    scanned (HDF5 reads and CRC-32C checks overlap the scan; the compiled loops leave the
    GIL). Two buffers, or four where rows are scanned in pairs (``pairs``: on the CPU with
    a running sum; two rows scanned, two read). Reused while the width and device stay
    the same."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._reader: ThreadPoolExecutor | None = None
        self._ahead: tuple | None = None  # (row key, future, buffer) of a read-ahead

    def ensure(self, width: int, device: torch.device, with_mean: bool) -> None:
        key = (width, str(device), with_mean)
        if key == self._key:
            return
        self._drop_ahead()
        self._key = None  # free the old buffers before allocating new ones
        self.buffers = self.sums = None
        self.pairs = with_mean and device.type == "cpu"
        # rows a caller may hold at once, and as many reads in flight behind them
        self.depth = 2 if self.pairs else 1
        self.buffers = tuple(np.empty(width, dtype=np.float32) for _ in range(2 * self.depth))
        self.sums = _CompensatedSum(width, device) if with_mean else None
        self.rooms = [Room(0), Room(0), Room(0)]  # the CPU scans' candidates: a pair, a mean
        self._key = key

    def candidate_room(self, which: int, d: int, k: int) -> Room:
        """The ``which``-th candidate room (0, 1: a pair's rows; 2: the mean), large enough
        for a row of ``d``'s top-k (:func:`~gradstat.stats.topk_sets.candidates_room`)."""
        if self.rooms[which].size < candidates_room(d, k):
            self.rooms[which] = Room(candidates_room(d, k))
        return self.rooms[which]

    def rows(
        self,
        cap: Capture,
        step: int,
        learners: Sequence[int],
        scope: Scope,
        start: int,
        stop: int,
        then: tuple[int, int, int] | None = None,
        after: Callable[[np.ndarray], Any] | None = None,
    ) -> Iterator[Any]:
        """Each learner's columns ``[start, stop)`` in turn, read in the background ahead
        of the caller: one row ahead, and a row handed out stays valid until the next is;
        with ``pairs``, two rows ahead, and a row stays valid until two more are handed
        out (a pair's first row is kept while its second is scanned, and the next pair is
        read meanwhile). ``then``: ``(step, start, stop)`` of the first learner's read
        likely asked for next (the next column block, or the walk's next step), read ahead
        once this call's last row is queued, into a buffer no row still valid uses, so
        that it overlaps this call's last scans; a later call for exactly that read takes
        it. ``after``: work on each row done by the reading thread once the row is read,
        in learner order, beside the caller's work on the rows before it; the rows then
        come as ``(row, after(row))``. A row read ahead is only read: the call that takes
        it has its ``after`` run first in line on the reading thread (the call before
        may still be using what ``after`` writes to)."""
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="gradstat-read")
        depth = self.depth  # reads in flight, and rows handed out that stay valid
        queue: deque[tuple[Future, int]] = deque()  # (read, buffer) in learner order
        handed: list[int] = []  # the buffers of the rows handed out, in order

        def read(
            at: int, learner: int, columns: tuple[int, int] = (start, stop), ahead: bool = False
        ) -> tuple[Future, int]:
            in_use = handed[-depth:] + [b for _, b in queue]
            if self._ahead is not None:
                in_use.append(self._ahead[2])
            into = next(b for b in range(len(self.buffers)) if b not in in_use)
            block = (cap, at, learner, scope, *columns, self.buffers[into])
            if after is None or ahead:
                return self._reader.submit(read_block, *block), into
            return self._reader.submit(_then, after, read_block, *block), into

        wanted = (str(cap.path), step, learners[0], scope, start, stop)
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == wanted:
            future, into = ahead[1:]
            if after is not None:  # queued behind the read on the one reading thread
                future = self._reader.submit(_then, after, future.result)
            queue.append((future, into))
        else:
            if ahead is not None:  # not the row wanted: let it land, then drop it
                wait([ahead[1]])
            queue.append(read(step, learners[0]))
        queued = 1  # learners whose read is queued
        try:
            for _ in learners:
                future, into = queue.popleft()
                handed.append(into)  # from here its buffer is the caller's
                while len(queue) < depth and queued < len(learners):
                    queue.append(read(step, learners[queued]))
                    queued += 1
                if len(queue) < depth and then is not None and self._ahead is None:
                    at, columns = then[0], then[1:]
                    key = (str(cap.path), at, learners[0], scope, *columns)
                    self._ahead = (key, *read(at, learners[0], columns, ahead=True))
                yield future.result()  # the next reads are queued behind it meanwhile
        finally:  # a read in flight must not land in a buffer someone reuses
            wait([future for future, _ in queue])

    def _drop_ahead(self) -> None:
        """Wait for a read-ahead to land and forget it."""
        if self._ahead is not None:
            wait([self._ahead[1]])
            self._ahead = None

    def release(self) -> None:
        """Free the buffers and stop the reading thread (both come back when needed)."""
        self._drop_ahead()
        self._key = None
        self.buffers = self.sums = None
        if self._reader is not None:
            self._reader.shutdown()
            self._reader = None


#: This process's buffers, kept from unit to unit: a fresh row costs its page faults
#: (measured: 30 ms a step of 8M values). The analyses release them when they finish.
_process_workspace = Workspace()


def _forget_reader() -> None:
    """In a forked child: the parent's reading thread (and any read it had in flight) is
    not there; a new thread starts when needed."""
    _process_workspace._reader = None
    _process_workspace._ahead = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_reader)


def release_workspace() -> None:
    """Free this process's top-k stream buffers (the end of an analysis)."""
    _process_workspace.release()


def _require_finite(step: int, learner: int, x: torch.Tensor, finite: bool | torch.Tensor) -> None:
    """Raise, with the exact count, when the row has NaN/Inf values. ``finite``: a quick
    answer that is True only when every value is finite (on a GPU, from float32 chunk
    sums, which a row of huge finite values can also overflow: then counted exactly)."""
    if bool(finite):
        return
    bad = int(torch.count_nonzero(~torch.isfinite(x)))
    if bad:
        raise DataError(
            f"step {step}, learner {learner}: {bad} NaN/Inf gradient values; a top-k set "
            "analysis needs finite gradients (leave the step out with --steps; "
            "`gradstat fit` excludes such values)"
        )


def _scan_row(
    x: torch.Tensor,
    k: int,
    start: int,
    space: Workspace,
    row: tuple[int, int, bool] | None,
) -> _Running:
    """One pass over a learner's block: finiteness, the running sum, and the top-k
    candidates (|x| >= t for a sampled t as in ``topk_indices``; all of it when the block
    is short or dense); then the exact top-k of the candidates. ``row``: (step, learner,
    first learner of the step) of a recorded row, which is checked and added to the
    running sum; None for the mean. On the CPU one fused loop
    (:func:`~gradstat.stats.row_kernels.scan_row`), on a GPU torch's ops chunk by chunk."""
    d = x.numel()
    k = min(k, d)
    threshold = prefilter_threshold(x, k)
    sums = space.sums if row is not None else None
    if x.device.type == "cpu":
        found = scan_row(
            x.numpy(),
            threshold,
            space.candidate_room(0, d, k),
            total=None if sums is None else sums.total[:d].numpy(),
            error=None if sums is None else sums.error[:d].numpy(),
            first=row is not None and row[2],
        )
        if row is not None:
            _require_finite(row[0], row[1], x, found.finite)
        return _top(x, k, start, threshold, found.indices, found.magnitudes)
    chunk_sums, found = [], []
    for lo in range(0, d, CHUNK):
        chunk = x[lo : lo + CHUNK]
        if row is not None:
            chunk_sums.append(chunk.sum())
        if sums is not None:
            sums.add(lo, chunk, first=row[2])
        if threshold is not None:
            found.append(indices_above(chunk, threshold).add_(lo))
    # finite when every value is, short of a float32 overflow far beyond any gradient
    finite = not chunk_sums or torch.stack(chunk_sums).isfinite().all()
    if row is not None:
        _require_finite(row[0], row[1], x, finite)
    candidates = None if threshold is None else torch.cat(found)
    idx = top_of_candidates(x, k, candidates)
    return _Running(x[idx].abs(), idx + start)


def _scan_pair(
    rows: tuple[tuple[torch.Tensor, tuple[int, int, bool]], ...],
    k: int,
    start: int,
    space: Workspace,
    mean_of: int | None = None,
) -> tuple[list[_Running], tuple[_Running, float] | None]:
    """:func:`_scan_row` of two recorded rows of a step, in order, on the CPU in one pass
    (:func:`~gradstat.stats.row_kernels.scan_row_pair`): the running sum is read and
    written once for both (made by them when the first is the step's first); the same
    sum and candidates as two scans. ``mean_of``: the step's learner count when these are
    its last two rows; the pass then leaves the mean in the sum's row
    (:class:`~gradstat.stats.row_kernels.MeanOf`) and also returns what
    :func:`_mean_top` would: its top-k and its sum of squares."""
    (a, a_row), (b, b_row) = rows
    d = a.numel()
    k = min(k, d)
    thresholds = prefilter_threshold(a, k), prefilter_threshold(b, k)
    rooms = space.candidate_room(0, d, k), space.candidate_room(1, d, k)
    total, error = space.sums.total[:d], space.sums.error[:d]
    first = a_row[2]
    mean = None
    if mean_of is not None:
        threshold = None
        if prefilters(d, k):  # the mean's sample, from the very operations of the pass
            at = sample_positions(d)
            sample = _pair_mean(a[at], b[at], total[at], error[at], first, mean_of).abs()
            threshold = prefilter_threshold(total, k, sample=sample)
        mean = MeanOf(mean_of, threshold, space.candidate_room(2, d, k))
    arrays = (a.numpy(), b.numpy())
    found = scan_row_pair(arrays, thresholds, rooms, total.numpy(), error.numpy(), first, mean)
    made = None
    if mean is not None and found.mean is not None:
        indices, magnitudes, squares = found.mean
        made = _top(total, k, start, mean.threshold, indices, magnitudes), squares
    tops = []
    rows_found = (found.a, found.b)
    for x, row, threshold, one in zip((a, b), (a_row, b_row), thresholds, rows_found, strict=True):
        _require_finite(row[0], row[1], x, one.finite)
        tops.append(_top(x, k, start, threshold, one.indices, one.magnitudes))
    return tops, made


def _pair_mean(
    a: torch.Tensor, b: torch.Tensor, s: torch.Tensor, c: torch.Tensor, first: bool, n: int
) -> torch.Tensor:
    """The mean a step's last pair leaves (:func:`~gradstat.stats.row_kernels.scan_row_pair`)
    at a few positions: a then b added to the compensated sum ``s``, ``c`` (or making it,
    when ``first``), then ``(s - c) / n``; float32, the same operations in the same order,
    so the same bits."""
    if first:
        s, c = a, torch.zeros_like(a)
    else:
        y = a - c
        t = s + y
        s, c = t, (t - s) - y
    y = b - c
    t = s + y
    return (t - ((t - s) - y)).div_(n)


def _top(
    x: torch.Tensor,
    k: int,
    start: int,
    threshold: float | None,
    indices: np.ndarray,
    magnitudes: np.ndarray,
) -> _Running:
    """The exact top-k of a CPU block from the candidates its scan found at ``threshold``
    (None: it found none, the top-k is taken from all of the block): as
    :func:`~gradstat.stats.topk_sets.top_of_candidates`, from the magnitudes the scan
    kept (no gathers from the block)."""
    if threshold is None or indices.size < k:  # none, or too few: from all of the block
        idx = top_of_candidates(x, k, None)
        return _Running(x[idx].abs(), idx + start)
    magnitudes = torch.from_numpy(magnitudes)
    keep = torch.topk(magnitudes, k, sorted=False).indices
    return _Running(magnitudes[keep], torch.from_numpy(indices)[keep] + start)


def _mean_top(
    k: int, start: int, n: int, mean: torch.Tensor, space: Workspace
) -> tuple[_Running, float]:
    """The mean of the step's ``n`` rows in this block, from the running sum, into
    ``mean`` (on the CPU); its top-k as :func:`_scan_row`'s; and its sum of squares
    (float64). One pass (:func:`~gradstat.stats.row_kernels.mean_row`): the pre-filter's
    sample is taken from the sum first, the very values the mean will have there."""
    d = mean.numel()
    k = min(k, d)
    total, error = space.sums.total[:d], space.sums.error[:d]
    threshold = None
    if prefilters(d, k):
        at = sample_positions(d)
        threshold = prefilter_threshold(mean, k, sample=(total[at] - error[at]).div_(n).abs())
    indices, magnitudes, squares = mean_row(
        total.numpy(), error.numpy(), n, mean.numpy(), threshold, space.candidate_room(0, d, k)
    )
    return _top(mean, k, start, threshold, indices, magnitudes), squares


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
    scope); exact, module docstring. ``workspace``: buffers to use (default: this
    process's, kept from call to call until :func:`release_workspace`); ``then``: the
    step likely asked for next, whose first row (first block) is read ahead; the first
    learner's next block is read ahead the same way.
    """
    d, n, kmax = scope.numel, len(learners), max(ks)
    block = min(block, d)
    space = workspace or _process_workspace
    space.ensure(block, device, with_mean)
    running: list[_Running | None] = [None] * (n + 1)
    total = torch.zeros((), dtype=torch.float64, device=device)
    blocks = list(column_blocks(d, block))
    for b, (start, stop) in enumerate(blocks):
        candidates = []
        if b + 1 < len(blocks):
            ahead = (step, *blocks[b + 1])
        else:
            ahead = None if then is None else (then, *blocks[0])
        rows = space.rows(cap, step, learners, scope, start, stop, ahead)
        held = None  # the first row of a pair (space.pairs), until its second comes
        made = None  # the mean's top-k and squares, when the step's last pair made it
        for i, (learner, view) in enumerate(zip(learners, rows, strict=True)):
            x = torch.from_numpy(view).to(device)
            row = (step, learner, i == 0)
            if not space.pairs:
                candidates.append(_scan_row(x, kmax, start, space, row))
            elif held is None:
                held = (x, row)
            else:
                mean_of = n if with_mean and i == n - 1 else None
                tops, made = _scan_pair((held, (x, row)), kmax, start, space, mean_of)
                candidates.extend(tops)
                held = None
        if held is not None:
            candidates.append(_scan_row(held[0], kmax, start, space, held[1]))
        if with_mean:  # the mean goes where the last row was (no longer needed)
            if made is not None:  # in the sum's row
                mean = space.sums.total[: stop - start]
                top, squares = made
                total += squares
            elif device.type == "cpu":
                mean = x
                top, squares = _mean_top(kmax, start, n, mean, space)
                total += squares
            else:
                mean = space.sums.mean(n, out=x)
                for chunk in mean.split(CHUNK):  # float32 cascade sums, added in float64
                    total += chunk.square().sum().double()
                top = _scan_row(mean, kmax, start, space, None)
            candidates.append(top)
            for c in candidates:
                c.mean_values = mean[c.indices - start].double()
        for i, c in enumerate(candidates):
            running[i] = c if running[i] is None else running[i].merge(c, kmax)
    rows = running[: n + 1 if with_mean else n]
    out = []
    for k in ks:
        tops = [r.top(k) for r in rows]
        indices = torch.stack([t.indices for t in tops])
        sparse = bool(torch.stack([t.magnitudes.min() for t in tops[:n]]).eq(0).any())
        energy = None
        if with_mean:
            energy = torch.stack([t.mean_values.square().sum() for t in tops]) / total
        out.append(StepSets(k, d, indices, energy, sparse))
    return out
