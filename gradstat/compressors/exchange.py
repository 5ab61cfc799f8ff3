"""What a compressor's exchange and the drivers that run it share.

A compressor's exchange is written once, as a generator (:meth:`Compressor.exchange
<gradstat.compressors.base.Compressor.exchange>`): it compresses one learner's vector
of one message, yields the collectives it needs and returns a :class:`Sent`. The ops it
yields, and what the driver sends back:

* :class:`AllReduce` ``(tensors)``: each tensor summed element-wise over the learners;
* :class:`AllGather` ``(tensors)``: every learner's tensors, in learner order;
* :class:`Broadcast` ``(tensor, root)``: ``root``'s tensor;
* :class:`Round` ``(sends, receives)``: one round of point-to-point messages (a tree's
  level): ``{peer: tensors}`` received, of the shapes and dtypes in ``receives``;
* :class:`Shared` ``(function, *args)``: ``function(*args)``, work that is the same on
  every learner (decoding the gathered payloads and aggregating them): training runs it
  on every learner, the replay once for all of them.

Training drives it with ``torch.distributed`` (:mod:`gradstat.compressors.communicator`),
the replay every learner's in lockstep (:mod:`gradstat.compressors.simulated`). A reply
is the driver's: read it, do not write into it (the replay hands every learner the same
one); gathered payloads are copies of what the learners sent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

#: A payload: the tensors one learner puts on the wire.
Tensors = Sequence[torch.Tensor]


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
    """A vector that is zero outside ``indices`` (distinct), with ``values`` there: what a
    sparsifier sent, or the aggregate of the learners' sparse payloads, without a dense
    row of ``numel`` values."""

    numel: int
    indices: torch.Tensor
    values: torch.Tensor

    def dense(self) -> torch.Tensor:
        """The vector as a dense tensor (the same numbers as a dense aggregate)."""
        row = torch.zeros(self.numel, dtype=self.values.dtype, device=self.values.device)
        row[self.indices.long()] = self.values
        return row


def dense(vector: torch.Tensor | SparseRow) -> torch.Tensor:
    """A flat dense tensor of ``vector``."""
    return vector.dense() if isinstance(vector, SparseRow) else vector.reshape(-1)


def sparse_mean(rows: Sequence[SparseRow], n: int) -> tuple[SparseRow, torch.Tensor]:
    """The sum of the learners' sparse ``rows`` divided by ``n``, at the indices any of
    them holds, and how many learners hold each. Each index's values are added in learner
    order from 0, then divided: bit for bit the dense sum learner by learner and ``/ n``."""
    every = torch.cat([row.indices.long() for row in rows])
    indices, position, holders = torch.unique(every, return_inverse=True, return_counts=True)
    values = torch.cat([row.values for row in rows])
    sums = torch.zeros(indices.numel(), dtype=values.dtype, device=values.device)
    sums.index_add_(0, position, values)
    return SparseRow(rows[0].numel, indices, sums.div_(n)), holders


@dataclass
class AllReduce:
    tensors: list[torch.Tensor]


@dataclass
class AllGather:
    tensors: list[torch.Tensor]


@dataclass
class Broadcast:
    tensor: torch.Tensor
    root: int


@dataclass
class Round:
    """One round of point-to-point messages: ``sends`` ``{peer: tensors}``; ``receives``
    ``{peer: [(shape, dtype), ...]}`` of what each peer sends this learner."""

    sends: dict[int, list[torch.Tensor]]
    receives: dict[int, list[tuple[tuple[int, ...], torch.dtype]]]


@dataclass
class Shared:
    function: Callable[..., Any]
    args: tuple


@dataclass
class Sent:
    """One learner's outcome of one message: what it contributed (``sent``: dense, flat,
    or a :class:`SparseRow`, or a function making it, called once by
    :meth:`contribution`; a residual memory keeps ``p - sent``), what every learner holds
    (``estimate``), the bytes it put into each collective, how many values it put on the
    wire (``selected``), the coordinates it sent (``indices``, for the build-up; None for
    a dense payload), numbers for the records (``info``), its payload and context (a
    GRACE memory's ``update`` takes them) and ``overhead_bytes`` beyond the payload
    (all-gather lengths and padding, a tree's counts)."""

    sent: Any
    estimate: torch.Tensor | SparseRow
    transfers: tuple[Transfer, ...]
    selected: int
    indices: torch.Tensor | None = None
    info: dict[str, float] = field(default_factory=dict)
    payload: Tensors = ()
    ctx: Any = None
    overhead_bytes: int = 0

    def contribution(self) -> torch.Tensor | SparseRow:
        """What this learner sent (made on first use: a replay without memory needs it
        not)."""
        if callable(self.sent):
            self.sent = self.sent()
        return self.sent


def advance(exchange: Any, reply: Any) -> tuple[Any, Sent | None]:
    """``(next op, None)``, or ``(None, outcome)`` once the exchange has returned."""
    try:
        return exchange.send(reply), None
    except StopIteration as stop:
        return None, stop.value


def drive(exchange: Any, answer: Callable[[Any], Any]) -> Sent:
    """Run one learner's ``exchange`` to its end, ``answer(op)`` replying to each op."""
    op, outcome = advance(exchange, None)
    while outcome is None:
        op, outcome = advance(exchange, answer(op))
    return outcome


@dataclass(frozen=True)
class Call:
    """Where one exchange runs: message ``index`` (``name``, the ``shape`` its vector is
    handed in, its parameters' ``shapes``) of recorded ``step`` on ``learner`` of
    ``learners``, with the run's ``seed``, and ``facts`` the memory found while forming
    the vector (``nonzeros``)."""

    name: str
    index: int
    step: int
    learner: int
    learners: int
    seed: int = 0
    shape: tuple[int, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()
    facts: dict[str, Any] = field(default_factory=dict, compare=False)

    def seed_of(self, shared: bool = False) -> int:
        """The seed of this call's draws: numpy's SeedSequence of (seed, step, learner,
        message); ``shared``: the same on every learner (seed, step, message)."""
        who = -1 if shared else self.learner
        words = [self.seed, self.step, who + 1, self.index]
        return int(np.random.SeedSequence(words).generate_state(1, np.uint64)[0] >> 1)

    def generator(self, shared: bool = False) -> torch.Generator:
        """A CPU generator seeded with :meth:`seed_of`: a window of steps draws what the
        same steps of a whole replay draw."""
        return torch.Generator().manual_seed(self.seed_of(shared))
