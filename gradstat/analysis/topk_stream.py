"""Top-k sets of one step, streamed one learner's row (or column block) at a time.

The top-k set analyses never stack a step's learners: each learner's row is seen in
place in the page cache (a view of the mapped rank file, checked against its CRC-32C;
:meth:`~gradstat.store.Capture.row_view`) or, where its bytes are not one run of the
file, read into one of a few reused buffers (a reading thread checks or reads the next
row meanwhile), moved to the compute device and scanned once (on the CPU in one fused
loop, :mod:`gradstat.stats.row_kernels`): checked for NaN/Inf, added to a compensated
float32 running sum (Kahan; the mean gradient, as accurate as a float64 sum) and cut to
its top-k candidates. On the CPU a step's rows are scanned in pairs, so that the sum is
read and written once for two rows (the same updates in the same order). Memory is the
rows seen or read (four on the CPU, where rows are read two ahead for the pairs; two on
a GPU), the sum and its compensation, and O(learners x k) for the index sets, whatever
the number of learners. A view costs no copy: 8M values x 4 learners, similarity 0.29 ->
0.18 s, build-up 0.19 -> 0.11 s (fresh processes, medians of 5 and 3).

When a row of the scope is longer than the memory budget allows
(``Compute.block_numel``), the scope is processed in column blocks: every learner's
block, then the next block. Top-k over blocks is exact: each block keeps the candidates
of its own top-k (any index of the global top-k is in its block's top-k) until a row has
k of them; from then on, only those at least as large as the k-th largest kept (the
row's floor, :class:`_RowCandidates`). The mean's value at each
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
    """The scope-local columns ``[start, stop)`` of one learner's row: seen in place in
    the page cache where they are one run of the file (:meth:`Capture.row_view`, no
    copy), else read into ``out``."""
    pieces = list(scope_pieces(scope, start, stop))
    if len(pieces) == 1:
        seen = cap.row_view(step, learner, slice(*pieces[0][:2]))
        if seen is not None:
            return seen
    view = out[: stop - start]
    for flat_start, flat_stop, local in pieces:
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
    thread that checks the next learner's row in place (a view of the file,
    :func:`read_block`), or reads it into a buffer, while the rows before it are scanned
    (CRC-32C checks and reads overlap the scan; the compiled loops leave the GIL). Two
    buffers, or four where rows are scanned in pairs (``pairs``: on the CPU with a running
    sum; two rows scanned, two read); a view stands in for its buffer, untouched, and its
    pages are given back when that buffer would be reused. Reused while the width and
    device stay the same."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._reader: ThreadPoolExecutor | None = None
        self._ahead: tuple | None = None  # (row key, future, buffer) of a read-ahead
        self._views: dict[int, tuple[Capture, int, np.ndarray]] = {}  # by buffer replaced
        self._spare: np.ndarray | None = None

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
        self._spare = None
        self._key = key

    def spare(self) -> np.ndarray:
        """A row buffer no read uses (allocated when first asked for): where the mean of
        an odd number of rows goes on the CPU when the last row is a view of the file,
        which must not be written to (copy-on-write pages)."""
        if self._spare is None:
            self._spare = np.empty_like(self.buffers[0])
        return self._spare

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
            self._forget(into)  # the row it stood for is no longer valid
            block = (cap, at, learner, scope, *columns, self.buffers[into])
            if after is None or ahead:
                return self._reader.submit(read_block, *block), into
            return self._reader.submit(_then, after, read_block, *block), into

        wanted = (str(cap.path), step, learners[0], scope, start, stop)
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == wanted:
            future, into = ahead[1:3]
            if after is not None:  # queued behind the read on the one reading thread
                future = self._reader.submit(_then, after, future.result)
            queue.append((future, into))
        else:
            if ahead is not None:  # not the row wanted: let it land, then drop it
                self._drop(ahead)
            queue.append(read(step, learners[0]))
        queued = 1  # learners whose read is queued
        try:
            for learner in learners:
                future, into = queue.popleft()
                handed.append(into)  # from here its buffer is the caller's
                while len(queue) < depth and queued < len(learners):
                    queue.append(read(step, learners[queued]))
                    queued += 1
                if len(queue) < depth and then is not None and self._ahead is None:
                    at, columns = then[0], then[1:]
                    key = (str(cap.path), at, learners[0], scope, *columns)
                    self._ahead = (key, *read(at, learners[0], columns, ahead=True), cap)
                result = future.result()
                self._note_view(into, cap, learner, result if after is None else result[0])
                yield result  # the next reads are queued behind it meanwhile
        finally:  # a read in flight must not land in a buffer someone reuses
            wait([future for future, _ in queue])

    def _note_view(self, into: int, cap: Capture, learner: int, row: np.ndarray) -> None:
        """Remember a row handed out in place of buffer ``into`` when it is a view of the
        file (:func:`read_block`), to give its pages back when ``into`` is reused."""
        if row.ctypes.data != self.buffers[into].ctypes.data:
            self._views[into] = (cap, learner, row)

    def _forget(self, into: int) -> None:
        """Give back the pages of the view that stood for buffer ``into``, if any: they
        stay in the page cache, but the process no longer counts them as resident."""
        seen = self._views.pop(into, None)
        if seen is not None:
            cap, learner, view = seen
            cap.forget_view(learner, view)

    def _drop(self, ahead: tuple) -> None:
        """Let a read-ahead land and drop it (giving back its pages if it is a view)."""
        (_, _, learner, *_), future, into, cap = ahead
        wait([future])
        if future.exception() is None:  # a failed read ahead is not this walk's error
            self._note_view(into, cap, learner, future.result())
            self._forget(into)

    def _drop_ahead(self) -> None:
        """Wait for a read-ahead to land and forget it."""
        if self._ahead is not None:
            self._drop(self._ahead)
            self._ahead = None

    def release(self) -> None:
        """Free the buffers and stop the reading thread (both come back when needed)."""
        self._drop_ahead()
        for into in list(self._views):
            self._forget(into)
        self._key = None
        self.buffers = self.sums = self._spare = None
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


def _threshold(x: torch.Tensor, k: int, floor: float | None) -> float | None:
    """A block's candidate threshold: the row's floor (:class:`_RowCandidates`), else
    one sampled from the block (``prefilter_threshold``; None: no pre-filter)."""
    return floor if floor is not None else prefilter_threshold(x, k)


def _scan_row(
    x: torch.Tensor,
    k: int,
    start: int,
    space: Workspace,
    row: tuple[int, int, bool] | None,
    floor: float | None = None,
) -> _Running:
    """One pass over a learner's block: finiteness, the running sum, and the top-k
    candidates (|x| >= t for the row's ``floor``, else a sampled t as in
    ``topk_indices``; all of it when the block is short or dense); then the exact top-k
    of the candidates. ``row``: (step, learner, first learner of the step) of a recorded
    row, which is checked and added to the running sum; None for the mean. On the CPU one
    fused loop (:func:`~gradstat.stats.row_kernels.scan_row`), on a GPU torch's ops chunk
    by chunk."""
    d = x.numel()
    k = min(k, d)
    threshold = _threshold(x, k, floor)
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
        return _top(x, k, start, threshold, found.indices, found.magnitudes, floor)
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
    floors: tuple[float | None, float | None, float | None] = (None, None, None),
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
    thresholds = _threshold(a, k, floors[0]), _threshold(b, k, floors[1])
    rooms = space.candidate_room(0, d, k), space.candidate_room(1, d, k)
    total, error = space.sums.total[:d], space.sums.error[:d]
    first = a_row[2]
    mean = None
    if mean_of is not None:
        threshold = floors[2]
        if threshold is None and prefilters(d, k):  # the mean's sample, from the pass's ops
            at = sample_positions(d)
            sample = _pair_mean(a[at], b[at], total[at], error[at], first, mean_of).abs()
            threshold = prefilter_threshold(total, k, sample=sample)
        mean = MeanOf(mean_of, threshold, space.candidate_room(2, d, k))
    arrays = (a.numpy(), b.numpy())
    found = scan_row_pair(arrays, thresholds, rooms, total.numpy(), error.numpy(), first, mean)
    made = None
    if mean is not None and found.mean is not None:
        indices, magnitudes, squares = found.mean
        made = _top(total, k, start, mean.threshold, indices, magnitudes, floors[2]), squares
    tops = []
    rows_found = (found.a, found.b)
    for x, row, threshold, one, floor in zip(
        (a, b), (a_row, b_row), thresholds, rows_found, floors[:2], strict=True
    ):
        _require_finite(row[0], row[1], x, one.finite)
        tops.append(_top(x, k, start, threshold, one.indices, one.magnitudes, floor))
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
    floor: float | None = None,
) -> _Running:
    """The exact top-k of a CPU block from the candidates its scan found at ``threshold``
    (None: it found none, the top-k is taken from all of the block): as
    :func:`~gradstat.stats.topk_sets.top_of_candidates`, from the magnitudes the scan
    kept (no gathers from the block). At the row's ``floor`` (:class:`_RowCandidates`)
    fewer than k candidates are every value of the block that can still count; at a
    sampled threshold they mean the sample misled."""
    if threshold is None or (indices.size < k and threshold != floor):  # from all of it
        idx = top_of_candidates(x, k, None)
        return _Running(x[idx].abs(), idx + start)
    magnitudes, indices = torch.from_numpy(magnitudes), torch.from_numpy(indices)
    if indices.numel() <= k:  # at the row's floor: every candidate
        return _Running(magnitudes.clone(), indices + start)
    keep = torch.topk(magnitudes, k, sorted=False).indices
    return _Running(magnitudes[keep], indices[keep] + start)


def _mean_top(
    k: int, start: int, n: int, mean: torch.Tensor, space: Workspace, floor: float | None = None
) -> tuple[_Running, float]:
    """The mean of the step's ``n`` rows in this block, from the running sum, into
    ``mean`` (on the CPU); its top-k as :func:`_scan_row`'s; and its sum of squares
    (float64). One pass (:func:`~gradstat.stats.row_kernels.mean_row`): the pre-filter's
    sample is taken from the sum first, the very values the mean will have there."""
    d = mean.numel()
    k = min(k, d)
    total, error = space.sums.total[:d], space.sums.error[:d]
    threshold = floor
    if threshold is None and prefilters(d, k):
        at = sample_positions(d)
        threshold = prefilter_threshold(mean, k, sample=(total[at] - error[at]).div_(n).abs())
    indices, magnitudes, squares = mean_row(
        total.numpy(), error.numpy(), n, mean.numpy(), threshold, space.candidate_room(0, d, k)
    )
    return _top(mean, k, start, threshold, indices, magnitudes, floor), squares


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
    running = [_RowCandidates(kmax) for _ in range(n + 1)]
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
        if with_mean:  # the mean goes where the last row was (no longer needed)
            if made is not None:  # in the sum's row
                mean = space.sums.total[: stop - start]
                top, squares = made
                total += squares
            elif device.type == "cpu":  # where the last row was, unless it is the file's
                own = x.data_ptr() in (buffer.ctypes.data for buffer in space.buffers)
                mean = x if own else torch.from_numpy(space.spare()[: stop - start])
                top, squares = _mean_top(kmax, start, n, mean, space, running[n].floor)
                total += squares
            else:
                mean = space.sums.mean(n, out=x)
                for chunk in mean.split(CHUNK):  # float32 cascade sums, added in float64
                    total += chunk.square().sum().double()
                top = _scan_row(mean, kmax, start, space, None, running[n].floor)
            candidates.append(top)
            for c in candidates:
                c.mean_values = mean[c.indices - start].double()
        for i, c in enumerate(candidates):
            running[i].add(c)
    rows = [r.joined() for r in running[: n + 1 if with_mean else n]]
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
