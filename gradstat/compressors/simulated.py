"""The replay's side of every exchange: all learners' exchanges driven in lockstep.

Each learner's :meth:`~gradstat.compressors.base.Compressor.exchange` of one message is
started as its row arrives (:class:`gradstat.analysis.replay_block.BlockStep`); once
every learner has started, :func:`lockstep` answers their collectives together, one op
at a time, until every exchange has returned. Each answer is formed once and handed to
every learner (:func:`answer`): an all-reduce is ``reduce`` of the learners' tensors
(:func:`sum_in_order` by default, the numbers of one process adding the rows).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any

import torch

from gradstat.compressors.exchange import Sent, advance

#: ``reduce(tensors)``: the learners' tensors of an all-reduce, in learner order, summed.
Reduce = Callable[[Sequence[torch.Tensor]], torch.Tensor]


def sum_in_order(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The float32 sum of ``parts`` added in learner order (a fresh tensor)."""
    total = parts[0].to(torch.float32, copy=True)
    for part in parts[1:]:
        total += part
    return total


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


def take(
    row: torch.Tensor, ranges: Sequence[tuple[int, int]], out: torch.Tensor | None = None
) -> torch.Tensor:
    """A message's vector from its block's row: a view of one range, else a copy (into
    ``out``, a buffer of the message's length, where given)."""
    if len(ranges) == 1:
        start, stop = ranges[0]
        return row[start:stop]
    return torch.cat([row[start:stop] for start, stop in ranges], out=out)
