"""The streamed replay: every chosen scheme stepped through its plan, block by block.

:func:`replay_streamed` walks the steps; per step and block of the plan (a column range
of the flat row: the model, a bucket, a few tensors; :mod:`gradstat.compressors.plan`)
it reads each learner's block once (a reading thread reads the next learner's while
this one is replayed, checks it finite and adds it to the block's reference sum) and
hands it to every scheme's :class:`~gradstat.analysis.replay_block.BlockStep`: the
learner's memory forms the corrected vectors and its compressor compresses them; once
every learner's block is in, each message is exchanged in lockstep and the memories
keep what was not sent. The memories' rows live in a :mod:`~gradstat.analysis.ef_store`
store (RAM or a scratch file); beyond them a block's rows of every learner are alive
(docs/large.md). The driver knows only the protocol; what an exchange does is its
compressor's business.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gradstat.analysis.ef_store import MemoryRows
from gradstat.analysis.replay_block import BlockStep, MessageOutcome
from gradstat.analysis.row_workspace import Workspace
from gradstat.compressors.registry import Scheme
from gradstat.compressors.simulated import take
from gradstat.errors import GradstatError
from gradstat.stats.row_kernels import add_checked
from gradstat.stats.rows import require_finite
from gradstat.store import Capture, Scope

__all__ = ["SchemeStep", "memory_bytes_needed", "replay_streamed"]


def memory_bytes_needed(schemes: Sequence[Scheme], learners: int) -> int:
    """Bytes the error-feedback memories of ``schemes`` take."""
    total = 0
    for s in schemes:
        compressed = sum(m.numel for m in s.plan.messages if not m.dense)
        total += s.memory.rows * learners * compressed * 4
    return total


@dataclass
class SchemeStep:
    """One scheme's step: each message's outcome, the dense update each is judged
    against (flat, in message order), the compression time per learner (memory,
    compressor and exchange; reads excluded); ``error``: why the scheme failed (its
    outcome then empty, and the scheme replays no further)."""

    messages: list[MessageOutcome] = field(default_factory=list)
    references: list[torch.Tensor] = field(default_factory=list)
    compress_seconds: float = 0.0
    error: BaseException | None = None


def replay_streamed(
    cap: Capture,
    steps: Sequence[int],
    learners: Sequence[int],
    chosen: Sequence[tuple[Scope, Scheme]],
    *,
    scratch: bool = False,
    tolerate: bool = False,
    keep_sent: bool = False,
) -> Iterator[tuple[int, list[SchemeStep]]]:
    """Replay the ``chosen`` (scope, scheme) pairs side by side over ``steps``, reading each
    learner's block once per step; yields ``(step, [SchemeStep per chosen])``.

    ``scratch`` keeps the memories in a scratch file (:mod:`~gradstat.analysis.ef_store`);
    ``tolerate``: a scheme whose code fails is reported in its ``error`` and dropped, the
    others go on (else the error is raised); ``keep_sent``: keep what each learner sent.
    A step's references share rows the next step reuses: use them before asking for the
    next step.
    """
    space = Workspace()  # the next learner's row is read while this one is replayed
    widest = max(block.numel for _, scheme in chosen for block in scheme.plan.blocks)
    space.ensure(widest)
    next_step = dict(itertools.pairwise(steps))
    failed: dict[int, BaseException] = {}
    try:
        with MemoryRows(scratch) as rows:
            for _, scheme in chosen:
                scheme.memory.allocate(len(learners), scheme.plan, rows.new)
            replayer = _Replayer(cap, learners, chosen, space, keep_sent)
            for step in steps:
                results = replayer.step(step, next_step.get(step), failed, tolerate)
                yield step, results
    finally:
        space.release()


class _Replayer:
    """One step of every chosen scheme at a time (see :func:`replay_streamed`)."""

    def __init__(self, cap, learners, chosen, space: Workspace, keep_sent: bool) -> None:
        self.cap, self.learners, self.chosen, self.space = cap, list(learners), chosen, space
        self.keep_sent = keep_sent
        #: each block's reference sum, kept from step to step: a fresh row costs its page
        #: faults (docs/large.md)
        self.totals: dict[tuple[str, int], torch.Tensor] = {}
        #: (scope, block) -> each message's copy of the mean where it is not one range
        self.references: dict[tuple[str, int], dict] = {}
        self.groups: dict[str, list[int]] = {}  # scope -> the chosen schemes on it
        for j, (sc, _) in enumerate(chosen):
            self.groups.setdefault(sc.name, []).append(j)

    def step(self, step: int, then: int | None, failed: dict, tolerate: bool) -> list[SchemeStep]:
        results = [SchemeStep() for _ in self.chosen]
        for members in self.groups.values():
            live = [j for j in members if j not in failed]
            if not live:
                continue
            sc, plan = self.chosen[live[0]][0], self.chosen[live[0]][1].plan
            columns = _columns(sc, plan)
            for b, block in enumerate(plan.blocks):
                # the read the reading thread does ahead: the next block, or the next step's first
                ahead = (step, *columns[b + 1]) if b + 1 < len(columns) else None
                if ahead is None and then is not None:
                    ahead = (then, *columns[0])
                self._block(step, b, block, columns[b], ahead, live, results, failed, tolerate)
        for j, error in failed.items():
            results[j] = SchemeStep(error=error)
        n = len(self.learners)
        for result in results:
            result.compress_seconds /= n
        return results

    def _block(self, step, b, block, columns, ahead, live, results, failed, tolerate) -> None:
        """Every learner's rows of ``block`` (the scope's ``columns``) to the live schemes'
        block steps, then their exchanges; the block's reference sum formed by the reading
        thread, which reads ``ahead`` (step, start, stop) next."""
        n = len(self.learners)
        scope = self.chosen[live[0]][0]
        key = (scope.name, b)
        total = self.totals.get(key)
        if total is None:
            total = self.totals[key] = torch.zeros(block.numel)
        else:  # the last step's reference is no longer used (see replay_streamed)
            total.zero_()

        def after(row: np.ndarray) -> bool:
            return add_checked(row, total.numpy())

        steps = {j: BlockStep(self.chosen[j][1], b, step, n, self.keep_sent) for j in live}
        rows = self.space.rows(self.cap, step, self.learners, scope, *columns, ahead, after)
        for i, (row, finite) in enumerate(rows):
            g = torch.from_numpy(row)
            if not finite:
                require_finite(step, g[None], [self.learners[i]], "replay")
            for j in list(steps):
                feed = steps[j].learner
                self._guard(j, lambda feed=feed, i=i, g=g: feed(i, g), steps, failed, tolerate)
        mean = total.div_(n)
        copies = self.references.setdefault(key, {})
        means = {}  # each message's part of the mean gradient, valid until the next step
        for m, ranges in zip(block.messages, block.ranges, strict=True):
            if len(ranges) > 1 and m not in copies:
                copies[m] = torch.empty(sum(stop - start for start, stop in ranges))
            means[m] = take(mean, ranges, copies.get(m))
        for j in list(steps):
            outcomes = self._guard(j, steps[j].finish, steps, failed, tolerate)
            if outcomes is None:
                continue
            scheme = self.chosen[j][1]
            for outcome in outcomes:
                results[j].references.append(scheme.reference(outcome.index, means[outcome.index]))
            results[j].messages += outcomes
            results[j].compress_seconds += steps[j].seconds

    @staticmethod
    def _guard(j, run, steps, failed, tolerate):
        """``run()``; a failure of scheme ``j`` is kept (``tolerate``) or raised."""
        try:
            return run()
        except (GradstatError, RuntimeError, ValueError, TypeError, IndexError) as exc:
            if not tolerate:
                raise
            failed[j] = exc
            del steps[j]
            return None


def _columns(scope: Scope, plan: Any) -> list[tuple[int, int]]:
    """Each block of ``plan`` (a plan of ``scope``'s layers) as ``(start, stop)`` columns of
    the scope: consecutive parameters, so one range each."""
    local, position = {}, 0
    for offset, numel in scope.slices:
        local[offset] = position
        position += numel
    columns = []
    for block in plan.blocks:
        first = block.slices[0][0]
        home = max(o for o in local if o <= first)  # the scope's slice holding it
        start = local[home] + first - home
        columns.append((start, start + block.numel))
    return columns
