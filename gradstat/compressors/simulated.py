"""The replay's side of every exchange: all learners' exchanges driven in lockstep.

Each learner's :meth:`~gradstat.compressors.base.Compressor.exchange` of one message is
started as its row arrives (:meth:`BlockStep.learner`: its memory forms the corrected
vector, the compressor compresses it up to its first collective); once every learner's
row of a block is in, :func:`lockstep` answers the learners' collectives together, one
op at a time, until every exchange has returned (no threads: the exchanges are
generators). A collective's answer is formed once and handed to every learner: an
all-reduce is ``reduce`` of the learners' tensors (:func:`sum_in_order` by default: a
float32 sum in learner order, the numbers of one process adding the rows; issue 37
plugs the emulation of a ring or tree with a number format on the wire in here), an
all-gather the learners' payloads copied, a :class:`~gradstat.compressors.exchange.
Shared` function of all learners' identical arguments computed once.

Lockstep holds every learner's rows of one block while its messages are exchanged: the
model's whole row per learner at ``model`` granularity, a bucket's at ``bucket``
(docs/large.md). :class:`BlockStep` is the one replay driver: the streamed replay
(:mod:`gradstat.analysis.replay_stream`) and :meth:`Scheme.step
<gradstat.compressors.registry.Scheme.step>` feed it rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gradstat.compressors.exchange import (
    Sent,
    SparseRow,
    Transfer,
)

#: ``reduce(tensors)``: the learners' tensors of an all-reduce, in learner order, summed.
Reduce = Callable[[Sequence[torch.Tensor]], torch.Tensor]


def sum_in_order(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The float32 sum of ``parts`` added in learner order (a fresh tensor)."""
    total = parts[0].to(torch.float32, copy=True)
    for part in parts[1:]:
        total += part
    return total


def advance(exchange: Generator, reply: Any) -> tuple[Any, Sent | None]:
    """``(next op, None)``, or ``(None, outcome)`` once the exchange has returned."""
    try:
        return exchange.send(reply), None
    except StopIteration as stop:
        return None, stop.value


def _same(ops: Sequence[Any], what: Callable[[Any], Any], label: str) -> Any:
    values = [what(op) for op in ops]
    if any(v != values[0] for v in values):
        raise RuntimeError(f"the learners' exchanges disagree on {label}: {values}")
    return values[0]


def answer(ops: Sequence[Any], reduce: Reduce = sum_in_order) -> list[Any]:
    """Every learner's reply to the learners' ``ops`` (one op each, of one kind)."""
    kind = _same(ops, lambda op: type(op).__name__, "the collective")
    n = len(ops)
    if kind == "AllReduce":
        count = _same(ops, lambda op: len(op.tensors), "the tensors all-reduced")
        summed = [reduce([op.tensors[j] for op in ops]) for j in range(count)]
        return [summed] * n
    if kind == "AllGather":
        gathered = [[t.clone() for t in op.tensors] for op in ops]
        return [gathered] * n
    if kind == "Broadcast":
        root = _same(ops, lambda op: op.root, "the broadcast's root")
        return [ops[root].tensor.clone()] * n
    if kind == "Round":
        return [
            {peer: [t.clone() for t in ops[peer].sends[i]] for peer in op.receives}
            for i, op in enumerate(ops)
        ]
    if kind == "Shared":
        _same(ops, lambda op: getattr(op.function, "__func__", op.function), "shared work")
        return [ops[0].function(*ops[0].args)] * n
    raise TypeError(f"an exchange yielded {kind}, not a collective")


def lockstep(
    exchanges: Sequence[Generator], ops: list[Any], reduce: Reduce = sum_in_order
) -> list[Sent]:
    """Drive the learners' ``exchanges`` (each waiting at its op in ``ops``) to their end."""
    results: list[Sent | None] = [None] * len(exchanges)
    while any(op is not None for op in ops):
        if any(op is None for op in ops):
            raise RuntimeError("the learners' exchanges made different numbers of collectives")
        for i, reply in enumerate(answer(ops, reduce)):
            ops[i], results[i] = advance(exchanges[i], reply)
    return results  # type: ignore[return-value]


@dataclass
class MessageOutcome:
    """One message of one step, every learner: the aggregate (flat, dense or sparse),
    the collectives (bytes per learner: the mean over learners), the values each learner
    put on the wire, each learner's memory's squared norm after it (NaN: unknown), the
    non-zeros of a sparse aggregate (``union``), how many coordinates exactly c = 1..n
    learners sent (``multiplicity``, where every learner's payload names its indices),
    the payloads' numbers (``info``, means) and, when asked for, what each learner sent."""

    index: int
    estimate: torch.Tensor | SparseRow
    transfers: tuple[Transfer, ...]
    selected: list[int]
    squares: list[float]
    union: int | None = None
    multiplicity: list[int] | None = None
    info: dict[str, float] | None = None
    sent: list[torch.Tensor | SparseRow] | None = None


def _transfers(results: Sequence[Sent]) -> tuple[Transfer, ...]:
    first = results[0].transfers
    return tuple(
        Transfer(t.collective, sum(r.transfers[j].nbytes for r in results) / len(results))
        for j, t in enumerate(first)
    )


def _info(results: Sequence[Sent]) -> dict[str, float]:
    keys = results[0].info
    return {key: sum(r.info[key] for r in results) / len(results) for key in keys}


def _union(results: Sequence[Sent], estimate: Any, n: int, sparsifier: bool) -> tuple:
    """``(union, multiplicity)`` of one message (see :class:`MessageOutcome`)."""
    if all(r.indices is not None for r in results):
        every = torch.cat([r.indices.long() for r in results])
        holders = torch.unique(every, return_counts=True)[1]
        return int(holders.numel()), torch.bincount(holders, minlength=n + 1)[1:].tolist()
    if isinstance(estimate, SparseRow):
        return int(estimate.indices.numel()), None
    if sparsifier:
        return int(torch.count_nonzero(estimate)), None
    return None, None


class BlockStep:
    """One scheme's step on one block of its plan (see the module docstring): feed each
    learner's row of the block with :meth:`learner` (learners 0..n-1, in order), then
    :meth:`finish`. ``seconds``: the time spent in both (reads excluded)."""

    def __init__(self, scheme: Any, block: int, step: int, learners: int, keep_sent: bool = False):
        self.scheme, self.block, self.step, self.n = scheme, block, step, learners
        self.spec = scheme.plan.blocks[block]
        self.keep_sent = keep_sent
        self.rows: list[Any] = []
        self.started: dict[int, list[tuple[Any, Any, Sent | None, torch.Tensor, Any]]] = {}
        self.dense: dict[int, torch.Tensor] = {}
        self.seconds = 0.0

    def learner(self, i: int, row: torch.Tensor) -> None:
        """Learner i's row of the block (column order; valid during this call only)."""
        start = time.perf_counter()
        scheme, memory = self.scheme, self.scheme.memory
        rows = memory.open(i, self.block)
        self.rows.append(rows)
        for m, ranges in zip(self.spec.messages, self.spec.ranges, strict=True):
            g = take(row, ranges)
            if scheme.plan.messages[m].dense:  # sent as it is: summed in learner order
                if i == 0:
                    self.dense[m] = g.to(torch.float32, copy=True)
                else:
                    self.dense[m] += g
                continue
            call = scheme.call(i, m, self.step, self.n)
            p = memory.compensate(rows, call, g)
            exchange = scheme.compressor(i, m).exchange(p.view(call.shape), call)
            op, result = advance(exchange, None)
            self.started.setdefault(m, []).append((exchange, op, result, p, call))
        self.seconds += time.perf_counter() - start

    def finish(self) -> list[MessageOutcome]:
        """Every message's lockstep exchange, the memories' updates: the outcomes."""
        start = time.perf_counter()
        scheme, memory = self.scheme, self.scheme.memory
        outcomes = []
        for m in self.spec.messages:
            if m in self.dense:
                outcomes.append(self._dense(m))
                continue
            started = self.started.pop(m)
            exchanges = [s[0] for s in started]
            results = lockstep(exchanges, [s[1] for s in started], scheme.reduce)
            results = [s[2] if s[1] is None else r for s, r in zip(started, results, strict=True)]
            squares = [
                memory.update(self.rows[i], call, p, result, scheme.compressor(i, m))
                for i, ((_, _, _, p, call), result) in enumerate(zip(started, results, strict=True))
            ]
            outcomes.append(self._outcome(m, results, squares))
        for i, rows in enumerate(self.rows):
            memory.close(i, self.block, rows)
        self.rows = []
        self.seconds += time.perf_counter() - start
        return outcomes

    def _outcome(self, m: int, results: list[Sent], squares: list[float]) -> MessageOutcome:
        estimate = results[0].estimate
        sparsifier = self.scheme.k(m) is not None
        union, multiplicity = _union(results, estimate, self.n, sparsifier)
        sent = [r.contribution() for r in results] if self.keep_sent else None
        selected = [r.selected for r in results]
        transfers, info = _transfers(results), _info(results)
        return MessageOutcome(
            m, estimate, transfers, selected, squares, union, multiplicity, info, sent
        )

    def _dense(self, m: int) -> MessageOutcome:
        """A message sent uncompressed: a float32 all-reduce of every value, averaged."""
        total = self.dense.pop(m).div_(self.n)
        numel = total.numel()
        transfers = (Transfer("allreduce", 4 * numel),)
        return MessageOutcome(m, total, transfers, [numel] * self.n, [0.0] * self.n, info={})


def take(row: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    """A message's vector from its block's row: a view of one range, else a copy."""
    if len(ranges) == 1:
        start, stop = ranges[0]
        return row[start:stop]
    return torch.cat([row[start:stop] for start, stop in ranges])
