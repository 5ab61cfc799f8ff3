"""The replay step of random-k and CLT-k: every learner sends its values at the same k
indices (the shared seed's draw, the leader's top-k), all-reduced.

The indices are chosen when the step begins (:meth:`SharedIndexStream.choose`); each
learner's values there are added to a k-vector, and its memory keeps the rest. With
plain error feedback ``p = m + g`` is formed in the memory row and the values sent are
zeroed there (``p - p`` where sent, ``p`` elsewhere: the same bits as ``p - sent``), the
new memory's norm following from ||p||^2 and the values sent; with ScaleCom's low-pass
memory (beta < 1) the memory's own update runs on a dense ``sent``.
"""

from __future__ import annotations

from typing import Any

import torch

from gradstat.compressors.exchange import ReadRow, SparseRow, StepOutcome, Stream, Transfer
from gradstat.compressors.memory import squares_left
from gradstat.compressors.sparse_stream import add_with_squares


class SharedIndexStream(Stream):
    """Values at indices every learner shares; a subclass chooses them."""

    def __init__(self, scheme: Any, name: str, learners: int, numel: int) -> None:
        self.compressor = scheme.compressor
        self.memory = scheme.memory
        self.n, self.d = learners, numel
        #: (leader, its corrected row, ||row||^2) when formed in its memory row
        self.formed: tuple[int, torch.Tensor, float | None] | None = None

    def choose(self, read_row: ReadRow) -> tuple[torch.Tensor, dict[str, float]]:
        """The step's k indices and the numbers a record shows (CLT-k's leader)."""
        raise NotImplementedError

    def transfers(self) -> tuple[Transfer, ...]:
        """The collectives of a step: the all-reduce of k float32 values."""
        return (Transfer("allreduce", self.compressor.k * 4),)

    def begin(self, read_row: ReadRow) -> None:
        self.formed = None
        self.indices, self.info = self.choose(read_row)
        self.values = torch.zeros(self.compressor.k)

    def learner(self, i: int, g: torch.Tensor) -> None:
        if not self.memory.plain_residual:
            p, state = self.memory.compensate(i, g)
            values = p[self.indices]
            self.values += values
            sent = torch.zeros(self.d)
            sent[self.indices] = values
            self.memory.update(i, p, sent, state)
            return
        if self.formed is not None and self.formed[0] == i:  # formed in begin
            _, p, squares = self.formed
            self.formed = None
        else:
            p = self.memory.m.load(i)
            squares = add_with_squares(p, g)
        p_at = p[self.indices]
        self.values += p_at
        p[self.indices] = 0.0  # p - p where sent, p elsewhere: the same bits
        if squares is not None:  # ||m||^2: ||p||^2 less the squares sent
            squares = squares_left(squares, p_at)
        self.memory.keep(i, p, squares)

    def finish(self) -> StepOutcome:
        k = self.compressor.k
        return StepOutcome(
            estimate=SparseRow(self.d, self.indices, self.values / self.n),
            transfers=self.transfers(),
            selected=[k] * self.n,
            memory_norm=self.memory.norm(),
            union=k,
            info=self.info,
        )
