"""One scheme's replay of one block of its plan, learners fed in order, the exchanges in
lockstep: the replay's driver (:mod:`gradstat.analysis.replay_stream` feeds it a
capture's rows; :func:`replay_rows` rows held in memory).

:class:`BlockStep`: each learner's row of a block (column order) goes to its memory
(:meth:`~gradstat.compressors.memory.Memory.compensate`: the corrected vector of each
message) and its compressor's exchange is started (compressed up to its first
collective); once every learner's row is in, every message is exchanged in lockstep
(:func:`gradstat.compressors.simulated.lockstep`) and the memories keep what was not
sent. A message of an HSDP unit (:attr:`~gradstat.compressors.plan.Message.replicate`
R > 1) is exchanged in lockstep within each shard group of n / R consecutive learners
(each learner's call numbers it within its group), as FSDP's reduce-scatter runs it,
and its aggregate is the mean of the groups' (FSDP's replicate all-reduce, in float32
and group order), or, where its replicate stage is compressed
(:attr:`~gradstat.compressors.plan.Message.replicate_compressed`, gradstat's own
``--hsdp``), :func:`replicate_stage`'s second exchange of the groups' means. Lockstep
holds every learner's rows of one block while its messages are exchanged: the model's
whole row per learner at ``model`` granularity, a bucket's at ``bucket``
(docs/large.md).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gradstat.compressors.exchange import Sent, SparseRow, Transfer, advance, dense
from gradstat.compressors.memory import TensorRows, joined
from gradstat.compressors.registry import Scheme
from gradstat.compressors.simulated import lockstep
from gradstat.errors import UsageError
from gradstat.wire.shards import pieces as shard_pieces
from gradstat.wire.shards import shard_of, unshard


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
    #: the last ``replicated`` of ``transfers`` run over HSDP's replicate groups (R
    #: learners each), the others over the shard groups
    replicated: int = 0


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

    def __init__(
        self,
        scheme: Any,
        block: int,
        step: int,
        learners: int,
        keep_sent: bool = False,
    ):
        self.scheme, self.block, self.step, self.n = scheme, block, step, learners
        self.spec = scheme.plan.blocks[block]
        self.keep_sent = keep_sent
        self.rows: list[Any] = []
        self.started: dict[int, list[tuple[Any, Any, Sent | None, torch.Tensor, Any]]] = {}
        self.dense: dict[int, list[torch.Tensor]] = {}
        self.seconds = 0.0

    def learner(self, i: int, row: torch.Tensor) -> None:
        """Learner i's row of the block (column order; valid during this call only)."""
        start = time.perf_counter()
        scheme, memory = self.scheme, self.scheme.memory
        rows = memory.open(i, self.block)
        self.rows.append(rows)
        for m, ranges in zip(self.spec.messages, self.spec.ranges, strict=True):
            # one range is a view; a message in another order than the row (a DDP bucket)
            # goes to the memory in pieces, not copied
            g = row[ranges[0][0] : ranges[0][1]] if len(ranges) == 1 else pieces(row, ranges)
            size = self.group_size(m)
            if scheme.plan.messages[m].dense:  # sent as it is: summed in learner order
                sums = self.dense.setdefault(m, [])
                if i % size == 0:  # a shard group's first learner
                    sums.append(joined(g).to(torch.float32, copy=True))
                else:
                    sums[-1] += joined(g)
                continue
            call = scheme.call(i % size, m, self.step, size)
            p = memory.compensate(rows, call, g)
            exchange = scheme.compressor(i, m).exchange(p.view(call.shape), call)
            op, result = advance(exchange, None)
            self.started.setdefault(m, []).append((exchange, op, result, p, call))
        self.seconds += time.perf_counter() - start

    def group_size(self, m: int) -> int:
        """The learners that exchange message ``m`` together (HSDP: one shard group)."""
        replicate = self.scheme.plan.messages[m].replicate
        if self.n % replicate:
            raise UsageError(
                f"FSDP unit {self.scheme.plan.messages[m].name} is replicated over {replicate} "
                f"shard groups: the replay needs every learner's rows, not {self.n}"
            )
        return self.n // replicate

    def finish(self) -> list[MessageOutcome]:
        """Every message's lockstep exchange, the memories' updates: the outcomes."""
        start = time.perf_counter()
        scheme, memory = self.scheme, self.scheme.memory
        outcomes = []
        for m in self.spec.messages:
            if m in self.dense:
                outcomes.append(self._dense(m))
                continue
            started, size = self.started.pop(m), self.group_size(m)
            results = []
            for first in range(0, self.n, size):  # each shard group's exchanges together
                group = started[first : first + size]
                ends = lockstep([s[0] for s in group], [s[1] for s in group], scheme.reduce)
                results += [s[2] if s[1] is None else r for s, r in zip(group, ends, strict=True)]
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
        size, replicated = self.group_size(m), ()
        means = [r.estimate for r in results[::size]]
        if self.scheme.plan.messages[m].replicate_compressed:
            estimate, replicated = replicate_stage(self.scheme, m, means, size, self.step)
        else:
            estimate = _replicas_mean(means)
        sparsifier = self.scheme.k(m) is not None
        union, multiplicity = _union(results, estimate, self.n, sparsifier)
        sent = [r.contribution() for r in results] if self.keep_sent else None
        selected = [r.selected for r in results]
        transfers, info = _transfers(results) + replicated, _info(results)
        return MessageOutcome(
            m, estimate, transfers, selected, squares, union, multiplicity, info, sent,
            len(replicated),
        )  # fmt: skip

    def _dense(self, m: int) -> MessageOutcome:
        """A message sent uncompressed: a float32 all-reduce of every value, averaged
        (within each shard group, then over the groups)."""
        total = _replicas_mean([s.div_(self.group_size(m)) for s in self.dense.pop(m)])
        numel = total.numel()
        transfers = (Transfer("allreduce", 4 * numel),)
        return MessageOutcome(m, total, transfers, [numel] * self.n, [0.0] * self.n, info={})


def replicate_stage(
    scheme: Scheme, m: int, means: Sequence[Any], shards: int, step: int
) -> tuple[torch.Tensor, tuple[Transfer, ...]]:
    """HSDP's compressed replicate stage of message ``m``: ``means``, each shard group's
    aggregate of it (group order; ``shards`` learners per group). For each shard index
    s, the groups' shards s (FSDP's layout, :func:`gradstat.wire.shards.shard_of`)
    are the R learners of one lockstep exchange of
    :meth:`~gradstat.compressors.registry.Scheme.replicate_stage` (a memory per learner
    of its own); their aggregates laid back in the message's order are the estimate.
    Returns it and the stage's collectives (bytes per learner: the mean over every
    learner, each in one exchange)."""
    replicas = len(means)
    stage = scheme.replicate_stage(shards, replicas)
    params = shard_pieces(scheme.plan.messages[m].shapes)
    replay = BlockStep(stage, m, step, replicas)
    for g, mean in enumerate(means):
        flat = dense(mean).to(torch.float32)
        replay.learner(g, torch.cat([shard_of(params, flat, shards, s) for s in range(shards)]))
    outcomes = sorted(replay.finish(), key=lambda outcome: outcome.index)
    estimate = torch.zeros(scheme.plan.messages[m].numel)
    unshard(params, torch.stack([dense(o.estimate) for o in outcomes]), estimate)
    first = outcomes[0].transfers
    transfers = tuple(
        Transfer(t.collective, sum(o.transfers[j].nbytes for o in outcomes) / len(outcomes))
        for j, t in enumerate(first)
    )
    return estimate, transfers


def _replicas_mean(estimates: list[torch.Tensor | SparseRow]) -> torch.Tensor | SparseRow:
    """The shard groups' aggregates averaged (one group: its own, unchanged): a float32
    sum in group order, divided by the groups."""
    if len(estimates) == 1:
        return estimates[0]
    dense = [e.dense() if isinstance(e, SparseRow) else e for e in estimates]
    total = dense[0].to(torch.float32, copy=True)
    for part in dense[1:]:
        total += part
    return total.div_(len(dense))


@dataclass
class StepOutcome:
    """One step of every learner over the whole plan (:func:`replay_rows`): the aggregate
    (flat, in the layer table's order), each message's outcome, the bytes each learner
    put into every collective, the values each learner sent, the mean of the learners'
    memory norms, the union of sparse sets and what each learner sent."""

    estimate: torch.Tensor
    messages: list[MessageOutcome]
    transfers: tuple[Transfer, ...]
    selected: list[int]
    memory_norm: float
    union: int | None
    sent: torch.Tensor

    @property
    def bytes_per_learner(self) -> float:
        return sum(t.nbytes for t in self.transfers)


def replay_rows(scheme: Scheme, grads: torch.Tensor, step: int | None = None) -> StepOutcome:
    """One step of every learner's flat rows ``grads[n, d]`` held in memory (from Python,
    tests, benchmarks): each block of ``scheme``'s plan through :class:`BlockStep`, its
    memory in RAM; ``step``: the recorded step (default: the steps counted from 0)."""
    n, d = grads.shape
    if not hasattr(scheme, "rows_replayed"):
        scheme.memory.allocate(n, scheme.plan, TensorRows)
        scheme.rows_replayed = 0
    at = scheme.rows_replayed if step is None else step
    scheme.rows_replayed += 1
    estimate, sent = torch.zeros(d), torch.zeros(n, d)
    outcomes = []
    for b, block in enumerate(scheme.plan.blocks):
        replay = BlockStep(scheme, b, at, n, keep_sent=True)
        for i in range(n):
            replay.learner(i, torch.cat([grads[i, o : o + k] for o, k in block.slices]))
        for outcome in replay.finish():
            message = scheme.plan.messages[outcome.index]
            scatter(estimate, message.slices, outcome.estimate)
            for i in range(n):
                part = outcome.sent[i] if outcome.sent else grads[i]
                scatter(sent[i], message.slices, part, whole=outcome.sent is None)
            outcomes.append(outcome)
    return _step_outcome(estimate, outcomes, sent, n)


def scatter(row: torch.Tensor, slices, vector, whole: bool = False) -> None:
    """Put a message's flat ``vector`` (dense or sparse) at its ``slices`` of ``row``
    (``whole``: ``vector`` is a full row, copy its slices)."""
    flat, position = dense(vector), 0
    for offset, numel in slices:
        source = flat[offset : offset + numel] if whole else flat[position : position + numel]
        row[offset : offset + numel] = source
        position += numel


def _step_outcome(estimate, outcomes: list[MessageOutcome], sent, n: int) -> StepOutcome:
    transfers = tuple(t for o in outcomes for t in o.transfers)
    selected = [sum(o.selected[i] for o in outcomes) for i in range(n)]
    squares = [sum(o.squares[i] for o in outcomes) for i in range(n)]
    unions = [o.union for o in outcomes if o.union is not None]
    union = sum(unions) if unions else None
    norm = sum(math.sqrt(s) for s in squares) / n
    return StepOutcome(estimate, outcomes, transfers, selected, norm, union, sent)


def pieces(row: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
    """Views of ``row`` at ``ranges``, in order."""
    return [row[start:stop] for start, stop in ranges]
