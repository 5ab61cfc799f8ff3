"""What a compressor and the drivers that run it exchange: payloads, the bytes of each
collective, one step's outcome and the replay's :class:`Stream` protocol.

The compressor protocol itself is :mod:`gradstat.compressors.base`; the replay drivers
(:mod:`~gradstat.compressors.streams`, :mod:`~gradstat.compressors.simulated`) and the
training form (:mod:`~gradstat.compressors.online`) need only these types, so they import
this module and not the protocol (no import circle).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

#: A payload: the tensors one learner puts on the wire.
Tensors = Sequence[torch.Tensor]
#: ``read_row(i)``: learner i's gradient row of the step (for a stream that needs it early).
ReadRow = Callable[[int], torch.Tensor]


def nbytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor occupies on the wire."""
    return tensor.numel() * tensor.element_size()


@dataclass(frozen=True)
class Transfer:
    """One collective call: its kind and the bytes each learner puts in (mean over learners)."""

    collective: str
    nbytes: float


@dataclass(frozen=True)
class SparseRow:
    """A row that is zero outside ``indices`` (distinct), with ``values`` there: the mean
    of what the learners of a sparsifier sent, kept without a dense row of ``numel``
    values (a dense aggregate is one more row per compressor, zeroed, added into,
    divided and read again every step: 128 MB at 32M values)."""

    numel: int
    indices: torch.Tensor
    values: torch.Tensor

    def dense(self) -> torch.Tensor:
        """The row as a dense tensor (the same numbers as a dense aggregate)."""
        row = torch.zeros(self.numel, dtype=self.values.dtype, device=self.values.device)
        row[self.indices] = self.values
        return row


@dataclass
class StepOutcome:
    """What one replayed step of all learners produced.

    ``estimate``: the aggregate every learner holds (dense, or a :class:`SparseRow`);
    ``transfers``: the collectives with the bytes each learner puts in; ``selected[i]``:
    how many elements learner i sent; ``memory_norm``: mean over learners of the memory's
    norm after the step; ``union``: non-zeros of a sparse aggregate (build-up), ``None``
    for dense ones; ``gathered_bytes``: what each learner holds after an all-gather;
    ``info``: per-payload numbers averaged over learners (``threshold``, ``stages``);
    ``multiplicity``: for all-gathered sparse sets, h(c), c = 1..n, how many coordinates
    exactly c learners sent (:func:`gradstat.stats.topk_sets.buildup_curve`).
    """

    estimate: torch.Tensor | SparseRow
    transfers: tuple[Transfer, ...]
    selected: list[int]
    memory_norm: float
    union: int | None = None
    gathered_bytes: float | None = None
    info: dict[str, float] = field(default_factory=dict)
    multiplicity: list[int] | None = None

    @property
    def bytes_per_learner(self) -> float:
        return sum(t.nbytes for t in self.transfers)


@dataclass
class OnlineStep:
    """One learner's outcome of one training step: what it contributed (``sent``, dense;
    its memory keeps ``p - sent``), what everyone holds (``estimate``), the bytes it put
    into each collective, how many elements it sent, and ``overhead_bytes`` beyond the
    payload (all-gather padding and lengths, gTop-k's node counts)."""

    sent: torch.Tensor
    estimate: torch.Tensor
    transfers: tuple[Transfer, ...]
    selected: int
    overhead_bytes: int = 0

    @property
    def payload_bytes(self) -> float:
        return sum(t.nbytes for t in self.transfers)


class Stream:
    """One scheme's replay step, fed one learner's row at a time (learners 0..n-1).

    ``begin(read_row)`` starts a step (``read_row(i)`` reads learner i's row of the
    scope, for a method that needs a row before its turn, e.g. CLT-k's leader);
    ``learner(i, g)`` feeds learner i's gradient row; ``finish()`` ends the step. The
    stream owns the step's arithmetic; the memory (``Memory``) owns the rows kept.
    """

    def begin(self, read_row: ReadRow) -> None:
        """Start a step."""

    def learner(self, i: int, g: torch.Tensor) -> None:
        """Feed learner i's gradient row."""
        raise NotImplementedError

    def finish(self) -> StepOutcome:
        """End the step: the aggregate and what travelled."""
        raise NotImplementedError
