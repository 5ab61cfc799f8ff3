"""The replay step of a sparsifier whose payload is ``(indices, values)`` with ``values``
the corrected vector's own values there, without dense rows.

For top-k and the threshold sparsifiers (their ``stream``), with plain error feedback
(beta = 1) or DGC's memories. The aggregate is a :class:`~gradstat.compressors.exchange.
SparseRow` (the mean at the indices any learner sent), never a dense sum; the memory is
formed in place:

* plain EF: ``p = g + m`` is formed in the memory row, the payload's values are kept and
  subtracted from ``p`` at their indices, leaving ``m = p - sent``. The same numbers as
  decompressing to a dense ``sent`` (adding or subtracting the zeros elsewhere changes
  nothing); a replay of top-k on 4 x 8M values spent half its time on those dense rows.
  ``p`` is formed with ||p||^2 in one pass and the new memory's norm follows from it
  and the values changed at the indices sent.
* DGC: the compressor selects from ``v``; ``u`` and ``v`` are zeroed where non-zero
  values were sent (:meth:`~gradstat.compressors.memory.DGCMemory.mask_sent`). A dense
  ``sent``, its mask and two masked fills were half of a DGC step.
"""

from __future__ import annotations

from typing import Any

import torch

from gradstat.compressors.base import index_dtype
from gradstat.compressors.exchange import SparseRow, StepOutcome, Tensors
from gradstat.compressors.memory import squares_left
from gradstat.compressors.streams import LocalStream
from gradstat.stats.row_kernels import add_squares


def fits(memory: Any) -> bool:
    """Whether :class:`SparseStream` serves ``memory``: plain EF or DGC's."""
    return memory.plain_residual or memory.masks_sent


def add_with_squares(p: torch.Tensor, g: torch.Tensor) -> float | None:
    """``p += g`` in place and ||p||^2 (float64) in one pass on the CPU
    (:func:`~gradstat.stats.row_kernels.add_squares`); elsewhere the add alone (None)."""
    if p.device.type == "cpu" and p.dtype == torch.float32 and g.dtype == torch.float32:
        return add_squares(p.numpy(), g.numpy())
    p.add_(g)
    return None


def sparse_payload(tensor: torch.Tensor, indices: torch.Tensor) -> Tensors:
    """``(indices, values)`` with int32 (or int64 past 2^31 elements) indices."""
    indices = indices.to(index_dtype(tensor.numel()))
    return indices, tensor[indices.long()]


def sparse_decompress(tensors: Tensors, numel: int) -> torch.Tensor:
    """Scatter ``(indices, values)`` into a dense zero vector of ``numel`` values."""
    indices, values = tensors
    out = torch.zeros(numel, dtype=values.dtype)
    out[indices.long()] = values
    return out


class SparseStream(LocalStream):
    """A sparsifier's replay step without dense rows (see the module docstring)."""

    def begin(self, read_row: Any) -> None:
        super().begin(read_row)
        self.values: list[torch.Tensor] = []  # of the payloads, in learner order

    def start_aggregate(self) -> None:
        """No dense sum: the aggregate is formed from the payloads kept."""

    def learner(self, i: int, g: torch.Tensor) -> None:
        if self.memory.plain_residual:
            self.residual_learner(i, g)
        else:
            self.masked_learner(i, g)

    def compress(self, i: int, p: torch.Tensor, **extra: Any) -> tuple[Tensors, Any]:
        """Learner i's payload of ``p`` (a subclass passes ``extra`` facts it knows)."""
        return self.compressors[i].compress(p, self.name)

    def residual_learner(self, i: int, g: torch.Tensor) -> None:
        """Plain EF: ``p`` formed in the memory row, ``m = p - sent`` left there."""
        p = self.memory.m.load(i)
        squares = add_with_squares(p, g)
        index, values = self.keep(i, *self.compress(i, p))
        p_at = p[index]
        p.index_add_(0, index, values, alpha=-1)  # indices are distinct: p[index] -= values
        if squares is not None:  # ||m||^2 from ||p||^2 and the values changed
            squares = squares_left(squares, p_at, p[index])
        self.memory.keep(i, p, squares)

    def masked_learner(self, i: int, g: torch.Tensor) -> None:
        """DGC: select from ``v``, then factor masking at the non-zero values sent."""
        v, state = self.memory.compensate(i, g)
        counted = state[2]
        extra = {} if counted is None else {"nonzeros": v.numel() - counted[0]}
        index, values = self.keep(i, *self.compress(i, v, **extra))
        self.memory.mask_sent(i, index[values != 0], state, values)

    def keep(self, i: int, tensors: Tensors, ctx: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep a payload's values for the aggregate, note the payload, and return
        (indices as int64, values)."""
        indices, values = tensors
        self.values.append(values)
        self.note(i, tensors, ctx, None)
        return indices.long(), values

    def finish(self) -> StepOutcome:
        estimate, holders = self.sparse_mean()
        return self.outcome(estimate, holders)

    def sparse_mean(self) -> tuple[SparseRow, torch.Tensor]:
        """The mean of the payloads kept, at the indices any learner sent, and how many
        learners sent each. Each index's values are added in learner order from 0, then
        divided by n: bit for bit the dense sum's ``index_add_`` learner by learner and
        ``div_``."""
        every = torch.cat([indices.long() for indices in self.indices])
        indices, position, holders = torch.unique(every, return_inverse=True, return_counts=True)
        values = torch.cat(self.values)
        sums = torch.zeros(indices.numel(), dtype=values.dtype, device=values.device)
        sums.index_add_(0, position, values)
        return SparseRow(self.d, indices, sums.div_(self.n)), holders
