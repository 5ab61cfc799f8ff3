"""Each step's learner x learner Gram matrix per scope, in one pass over the rows.

Contract: :meth:`Grams.step` returns, for one step, one float64 ``[n, n]`` matrix per
scope, ``G[a, b] = g_a . g_b`` of the n selected learners' gradients restricted to the
scope. Every number ``gradstat noise`` and ``gradstat consistency`` report is a function
of it (docs/methods.md 8). The rows are read in column blocks (:func:`block_width`,
:func:`plan_blocks`) into two ``[n, width]`` float32 buffers a unit keeps, the next block
read by a thread; a block's Gram is float32 products over ``CHUNK`` columns added in
float64 (:func:`chunk_products`, :func:`_add_block`), the same to the bit whatever the
block width (docs/noise.md, "Precision and cost").
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from gradstat import cancel
from gradstat.analysis.compute import Compute
from gradstat.analysis.selection import Selection
from gradstat.errors import DataError, UsageError
from gradstat.parallel import planned_workers, runs
from gradstat.stats.rows import require_finite
from gradstat.store import Capture, Scope

#: Columns per float32 matrix product: float32 accumulates this many terms, float64 the rest.
CHUNK = 1 << 11
#: Columns read per learner and block, about (rounded to the capture's checksum block):
#: 4 MiB of float32, so that a step's reads are few and the first, which nothing
#: overlaps, is a small part of them.
READ_BLOCK = 1 << 20
#: Values of a cache line (64 bytes of float32): the alignment of the buffers' rows.
ALIGN = 16
#: Fewest columns per block, whatever the memory budget (below this the per-block costs
#: dominate).
MIN_BLOCK = 1 << 12


@dataclass(frozen=True)
class Block:
    """Flat columns ``[start, stop)`` read per learner, and the ``(scope index, lo, hi)``
    pieces of it (block-local columns) that belong to each scope."""

    start: int
    stop: int
    pieces: tuple[tuple[int, int, int], ...]


def require_learners(selection: Selection, what: str) -> None:
    """The Gram's analyses compare learners: a ``UsageError`` for fewer than 2."""
    if len(selection.learners) < 2:
        raise UsageError(
            f"{what} compares learners and needs at least 2; the selection has "
            f"{len(selection.learners)}"
        )


def step_units(cap: Capture, selection: Selection, compute: Compute) -> list[tuple]:
    """The units of a Gram analysis: runs of consecutive steps, one per process that
    runs units (a unit keeps its :class:`Grams` buffers from step to step); each step's
    Gram is the same whichever unit computes it."""
    return runs(selection.steps, planned_workers(cap, selection, compute.jobs))


def block_width(cap: Capture, learners: int, compute: Compute) -> int:
    """Columns per block: about ``READ_BLOCK``, a multiple of ``cap.check_columns``;
    fewer where two ``[learners, width]`` float32 buffers would exceed the compute's
    memory budget (then a multiple of the checksum block if one fits, else of
    ``CHUNK``; at least ``MIN_BLOCK``)."""
    unit = cap.check_columns
    wanted = max(unit, READ_BLOCK // unit * unit)
    fits = max(MIN_BLOCK, compute.memory_bytes() // (2 * 4 * learners))
    if wanted <= fits:
        return wanted
    return fits // unit * unit if fits >= unit else fits // CHUNK * CHUNK


def plan_blocks(scopes: Sequence[Scope], width: int) -> list[Block]:
    """The blocks that cover every scope's slices once, in file order, cut at the
    multiples of ``width`` flat columns and where the slices leave a gap (a regex scope:
    the gap is never read); scopes of one selection never overlap."""
    pieces = sorted(
        (offset, offset + numel, k) for k, sc in enumerate(scopes) for offset, numel in sc.slices
    )
    blocks: list[Block] = []
    current: list[tuple[int, int, int]] = []  # (lo, hi, scope) in flat columns

    def close() -> None:
        start = current[0][0]
        local = tuple((k, lo - start, hi - start) for lo, hi, k in current)
        blocks.append(Block(start, current[-1][1], local))
        current.clear()

    for lo, hi, k in pieces:
        while lo < hi:
            if current and (current[-1][1] != lo or lo % width == 0):
                close()
            cut = min(hi, (lo // width + 1) * width)
            current.append((lo, cut, k))
            lo = cut
    if current:
        close()
    return blocks


def _read_block(
    cap: Capture, step: int, learners: Sequence[int], block: Block, out: np.ndarray
) -> np.ndarray:
    """Every learner's columns of ``block`` into the rows of ``out``, from the column
    ``block.start % ALIGN`` on (:func:`_aligned_buffer`)."""
    lo = block.start % ALIGN
    hi = lo + block.stop - block.start
    for i, learner in enumerate(learners):
        cap.read_row(step, learner, out=out[i, lo:hi], columns=slice(block.start, block.stop))
    return out[:, lo:hi]


def _aligned_buffer(rows: int, width: int) -> np.ndarray:
    """``[rows, w]`` float32, w >= ``width + ALIGN`` a multiple of ``ALIGN``, each row at a
    multiple of ``ALIGN`` values in memory: a flat column c read to ``c % ALIGN`` on
    lies at the same alignment whatever the block, and the BLAS gives its products the
    same rounding (it rounds differently at different alignments)."""
    w = -(-(width + ALIGN) // ALIGN) * ALIGN
    flat = np.empty(rows * w + ALIGN, dtype=np.float32)
    skip = -(flat.ctypes.data // 4) % ALIGN
    return flat[skip : skip + rows * w].reshape(rows, w)


class Grams:
    """A unit's Gram pass over ``learners``' rows in ``scopes``: the blocks planned and
    the two ``[n, width]`` float32 buffers allocated once, reused from step to step (a
    fresh buffer costs its page faults at every step); ``what``: the analysis, for
    messages."""

    def __init__(
        self,
        cap: Capture,
        learners: Sequence[int],
        scopes: Sequence[Scope],
        compute: Compute,
        what: str,
    ) -> None:
        self.cap, self.learners, self.scopes, self.what = cap, list(learners), scopes, what
        self.device = compute.torch_device()
        n = len(self.learners)
        self.blocks = plan_blocks(scopes, block_width(cap, n, compute))
        width = max(b.stop - b.start for b in self.blocks)
        self.buffers = [_aligned_buffer(n, width) for _ in range(2)]

    def step(self, step: int) -> list[np.ndarray]:
        """The Gram matrix of the learners' rows at ``step`` in each scope (module
        docstring); a ``DataError`` naming step and learner for NaN/Inf values."""
        n, blocks, learners = len(self.learners), self.blocks, self.learners
        sums = torch.zeros(len(self.scopes), n, n, dtype=torch.float64, device=self.device)
        with ThreadPoolExecutor(1, thread_name_prefix="gradstat-gram") as reader:
            pending = reader.submit(
                _read_block, self.cap, step, learners, blocks[0], self.buffers[0]
            )
            for i, block in enumerate(blocks):
                x = pending.result()
                if i + 1 < len(blocks):
                    later = (self.cap, step, learners, blocks[i + 1], self.buffers[(i + 1) % 2])
                    pending = reader.submit(_read_block, *later)
                cancel.check()
                x = torch.from_numpy(x).to(self.device)
                _add_block(x, block, sums, step, learners, self.what)
        sums = (sums + sums.transpose(1, 2)) / 2  # float32 products are not quite symmetric
        return list(sums.cpu().numpy())


def _add_block(
    x: torch.Tensor,
    block: Block,
    sums: torch.Tensor,
    step: int,
    learners: Sequence[int],
    what: str,
) -> None:
    """Add the Gram of each piece of ``x [n, width]`` to its scope's float64 sum: the
    chunks' products one after another (a running sum), so that the sum is the same
    whatever the block width (``--memory``, ``--jobs``)."""
    for k, lo, hi in block.pieces:
        part = x[:, lo:hi]
        products = chunk_products(part, block.start + lo)
        if not bool(torch.isfinite(products.diagonal(dim1=1, dim2=2)).all()):
            _refuse(part, step, learners, what)
        running = torch.cat([sums[k][None], products.to(torch.float64)])
        sums[k] = running.cumsum(dim=0)[-1]


def chunk_products(x: torch.Tensor, first: int) -> torch.Tensor:
    """``[chunks, n, n]`` float32: the Gram of each run of ``x [n, w]`` between the
    multiples of ``CHUNK`` flat columns (``first``: the flat column of ``x[:, 0]``; the
    first and last runs may be shorter), one batched product over a strided view of the
    whole runs (no copy)."""
    w = x.shape[1]
    head = min(w, -first % CHUNK)
    whole = head + (w - head) // CHUNK * CHUNK
    products = []
    for lo, hi in ((0, head), (whole, w)):
        if lo < hi:
            rest = x[:, lo:hi]
            products.append((rest @ rest.T)[None])
    if head < whole:
        runs = x[:, head:whole].unflatten(1, (-1, CHUNK)).transpose(0, 1)
        products.insert(bool(head), torch.bmm(runs, runs.transpose(1, 2)))
    return products[0] if len(products) == 1 else torch.cat(products)


def _refuse(part: torch.Tensor, step: int, learners: Sequence[int], what: str) -> None:
    """The error for a chunk whose squared norms are not finite: NaN/Inf values (named
    with their count), else values so large that their squares overflow float32."""
    require_finite(step, part, learners, what)
    overflow = torch.nonzero(~torch.isfinite((part * part).sum(dim=1)))
    big = int(overflow[0]) if len(overflow) else 0
    raise DataError(
        f"step {step}, learner {learners[big]}: gradient values beyond 1e19, whose squares "
        f"overflow float32; {what} needs gradients of a sane size"
    )
