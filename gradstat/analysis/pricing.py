"""Compression prices measured on this machine: one learner's step of a scheme, timed
(docs/replay.md, "On this machine").

One learner's step over every message of the plan (its memory, its compressor's
exchange and every learner's repeated work) on a real gradient row, with a loopback
communicator standing in for the others (:class:`Loopback`), timed with one and with
``n`` copies of an all-gathered payload: the price at ``N`` learners is ``t(1) + (t(n) -
t(1)) (N - 1) / (n - 1)``. Times are thread CPU time, the median of
:data:`~gradstat.compressors.targets.REPEATS` warm rounds (fewer for a long step:
:func:`rounds_for`), as the built-in profile's rates are (:mod:`gradstat.compressors.targets`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gradstat.compressors.exchange import AllGather, AllReduce, Broadcast, Round, Shared, drive
from gradstat.compressors.memory import TensorRows
from gradstat.compressors.registry import Scheme, build_scheme
from gradstat.compressors.simulated import take
from gradstat.compressors.targets import REPEATS, Timing, time_operations

#: Seconds of timed rounds beyond which a long step is timed fewer times (:func:`rounds_for`).
ROUNDS_SECONDS = 2.0


@dataclass(frozen=True)
class Price:
    """One learner's measured compression seconds per step: ``base`` with one copy of
    an all-gathered payload, ``per_payload`` more for each further one, and the
    ``spread`` of the measurement."""

    base: float
    per_payload: float
    spread: float

    def at(self, learners: int) -> float:
        """The seconds with ``learners`` learners."""
        return self.base + self.per_payload * max(learners - 1, 0)


class Loopback:
    """One learner's collectives answered from its own data: an all-reduce hands back
    its own tensors, an all-gather ``copies`` of its own payload, a broadcast its own
    tensor, a round of point-to-point messages zeros of the shapes expected."""

    def __init__(self, copies: int) -> None:
        self.copies = copies

    def answer(self, op: Any) -> Any:
        if isinstance(op, AllReduce):
            return [t.to(torch.float32, copy=True) for t in op.tensors]
        if isinstance(op, AllGather):
            return [[t.clone() for t in op.tensors] for _ in range(self.copies)]
        if isinstance(op, Broadcast):
            return op.tensor.clone()
        if isinstance(op, Round):
            return {
                peer: [torch.zeros(shape, dtype=dtype) for shape, dtype in templates]
                for peer, templates in op.receives.items()
            }
        if isinstance(op, Shared):
            return op.function(*op.args)
        raise TypeError(f"an exchange yielded {type(op).__name__}, not a collective")


def _stepper(scheme: Scheme, row: torch.Tensor, copies: int, learners: int):
    """A function running one learner's step of ``scheme`` on the flat ``row``."""
    plan, memory = scheme.plan, scheme.memory
    memory.allocate(1, plan, TensorRows)
    counter = iter(range(1 << 62))

    def step() -> None:
        at = next(counter) * learners  # learner 0 leads every step (CLT-k: all wait for it)
        loopback = Loopback(copies)
        for b, block in enumerate(plan.blocks):
            rows = memory.open(0, b)
            part = torch.cat([row[o : o + k] for o, k in block.slices])
            for m, ranges in zip(block.messages, block.ranges, strict=True):
                if plan.messages[m].dense:
                    continue
                call = scheme.call(0, m, at, learners)
                p = memory.compensate(rows, call, take(part, ranges))
                compressor = scheme.compressor(0, m)
                outcome = drive(compressor.exchange(p.view(call.shape), call), loopback.answer)
                memory.update(rows, call, p, outcome, compressor)
            memory.close(0, b, rows)

    return step


def rounds_for(seconds: float) -> int:
    """Timed rounds for a step of about ``seconds``: :data:`REPEATS` while they take at
    most :data:`ROUNDS_SECONDS`, fewer for longer steps (at least 3), whose median moves
    little from round to round (large messages) and which would otherwise cost the
    pricing more than the replay."""
    if not seconds > 0 or seconds * REPEATS <= ROUNDS_SECONDS:
        return REPEATS
    return max(3, min(REPEATS, int(ROUNDS_SECONDS / seconds)))


def measure_price(
    scheme: Scheme,
    row: torch.Tensor,
    learners: int,
    *,
    extrapolate: bool = True,
    rounds: int = REPEATS,
) -> Price:
    """The :class:`Price` of one learner's step of ``scheme`` (its spec, rate and plan:
    fresh objects, so its replay's state is untouched) on the flat gradient ``row``,
    with ``learners`` (>= 2) the replayed learners, over ``rounds`` timed rounds.
    Without ``extrapolate`` only the step with ``learners`` copies is timed: the price
    holds at that size alone (``per_payload`` 0)."""
    learners = max(learners, 2)
    steps = {"many": learners, "one": 1} if extrapolate else {"many": learners}
    timings: dict[str, Timing] = time_operations(
        {
            name: _stepper(
                build_scheme(scheme.spec, scheme.ratio, scheme.plan, seed=scheme.seed),
                row,
                copies,
                learners,
            )
            for name, copies in steps.items()
        },
        repeats=rounds,
    )
    full = timings["many"].median
    if not extrapolate:
        return Price(full, 0.0, timings["many"].spread)
    base = timings["one"].median
    per_payload = max(full - base, 0.0) / (learners - 1)
    return Price(base, per_payload, timings["many"].spread)
