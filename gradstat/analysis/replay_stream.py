"""The streamed replay: every chosen scheme fed one learner's row at a time.

:func:`replay_streamed` reads each learner's row of a step once and hands it to every
chosen (scope, scheme) pair's :class:`~gradstat.compressors.exchange.Stream`, the replay form
of the compressor (``compressor.stream``): the row is error-corrected with that learner's
memory (its rows kept in a :mod:`~gradstat.analysis.ef_store` store: RAM or a scratch
file), compressed and added to the running aggregate, so that beyond the memories only a
few rows of ``d`` values are alive. The driver knows only the protocol
(:mod:`gradstat.compressors.base`); what a stream does is its compressor's business.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from gradstat.analysis.ef_store import MemoryRows
from gradstat.analysis.row_workspace import Workspace
from gradstat.compressors.exchange import SparseRow, StepOutcome, Stream
from gradstat.compressors.registry import Scheme
from gradstat.stats.row_kernels import add_checked
from gradstat.stats.rows import require_finite
from gradstat.store import Capture, Scope

__all__ = ["SchemeStep", "SparseRow", "StepOutcome", "memory_bytes_needed", "replay_streamed"]


def streamed(scheme: Scheme, name: str, learners: int, numel: int, rows: MemoryRows) -> Stream:
    """The streamed form of ``scheme`` on scope ``name`` for ``learners`` rows of
    ``numel`` values, its memory's rows allocated in ``rows``."""
    scheme.memory.allocate(learners, numel, rows.new)
    return scheme.compressor.stream(scheme, name, learners, numel)


def memory_bytes_needed(schemes: Sequence[Scheme], learners: int, numel: Sequence[int]) -> int:
    """Bytes the error-feedback memories of ``schemes`` (scope sizes ``numel``) take."""
    return sum(s.memory.rows * learners * d * 4 for s, d in zip(schemes, numel, strict=True))


@dataclass
class SchemeStep:
    """One scheme's step: the outcome, the dense update it is judged against, and the
    compression time per learner (memory, compressor and aggregate; reads excluded)."""

    outcome: StepOutcome
    reference: torch.Tensor
    compress_seconds: float


def _add_to(
    sums: dict[str, torch.Tensor], scopes: Sequence[Scope], row: np.ndarray
) -> tuple[dict[str, torch.Tensor], bool]:
    """Each scope's part of a learner's row added to its reference sum, and checked finite
    in the same pass (:func:`~gradstat.stats.row_kernels.add_checked`): (the parts,
    whether every value was finite). The reading thread runs it as each row lands, so the
    sum costs the replay's own thread nothing (4 of about 20 ms per row of 8M values)."""
    g = torch.from_numpy(row)
    parts = {sc.name: sc.take(g) for sc in scopes}
    finite = True
    for name, part in parts.items():
        finite &= add_checked(part.numpy(), sums[name].numpy())
    return parts, finite


def replay_streamed(
    cap: Capture,
    steps: Sequence[int],
    learners: Sequence[int],
    chosen: Sequence[tuple[Scope, Scheme]],
    *,
    scratch: bool = False,
) -> Iterator[tuple[int, list[SchemeStep]]]:
    """Replay the ``chosen`` (scope, scheme) pairs side by side over ``steps``, reading each
    learner's row once per step; yields ``(step, [SchemeStep per chosen])``.

    ``scratch`` keeps the memories in a scratch file (:mod:`~gradstat.analysis.ef_store`).
    A step's estimates and references may share rows the next step reuses: use them
    before asking for the next step.
    """
    space = Workspace()  # the next learner's row is read while this one is replayed
    space.ensure(cap.numel)
    next_step = dict(itertools.pairwise(steps))
    try:
        with MemoryRows(scratch) as rows:
            replayer = _Replayer(cap, learners, chosen, rows, space)
            for step in steps:
                yield step, replayer.step(step, next_step.get(step))
    finally:
        space.release()


class _Replayer:
    """One step of every chosen scheme at a time (see :func:`replay_streamed`): each
    stream's ``begin``, every learner's row to every stream, each stream's ``finish``;
    the time each spends, without the reads, is its ``compress_seconds``."""

    def __init__(
        self,
        cap: Capture,
        learners: Sequence[int],
        chosen: Sequence[tuple[Scope, Scheme]],
        rows: MemoryRows,
        space: Workspace,
    ) -> None:
        self.cap, self.learners, self.chosen, self.space = cap, learners, chosen, space
        self.n = n = len(learners)
        self.streams = [streamed(scheme, sc.name, n, sc.numel, rows) for sc, scheme in chosen]
        self.scopes = list({sc.name: sc for sc, _ in chosen}.values())
        self.whole = Scope("model", ((0, cap.numel),))
        # a scope of every value: the reading thread's check covers the row
        self.whole_scope = any(sc.numel == cap.numel for sc in self.scopes)
        self.sums = {sc.name: torch.zeros(sc.numel) for sc in self.scopes}

    def checked(self, g: torch.Tensor, i: int) -> torch.Tensor:
        """``g``, learner i's row of this step, if finite (one cheap pass; then the
        culprit is named)."""
        if not math.isfinite(float(g.sum())):
            require_finite(self.current, g[None], [self.learners[i]], "replay")
        return g

    def read_row(self, i: int) -> torch.Tensor:
        """Learner i's row of this step, read now (a stream's ``begin`` needs it early)."""
        start = time.perf_counter()
        g = self.checked(torch.from_numpy(self.cap.read_row(self.current, self.learners[i])), i)
        self.reading += time.perf_counter() - start
        return g

    def step(self, step: int, then: int | None) -> list[SchemeStep]:
        """Replay ``step`` (``then``: the next step, whose first row is read ahead)."""
        self.current, self.reading = step, 0.0
        self.spent = [0.0] * len(self.streams)
        for j, ((sc, _), stream) in enumerate(zip(self.chosen, self.streams, strict=True)):
            start, before = time.perf_counter(), self.reading
            stream.begin(lambda i, sc=sc: sc.take(self.read_row(i)))
            self.spent[j] += time.perf_counter() - start - (self.reading - before)
        self.feed(step, then)
        return self.finish()

    def feed(self, step: int, then: int | None) -> None:
        """Every learner's row to every stream. The reading thread adds each row to the
        reference sums, in learner order, and reads the next step's first row while this
        step's last is replayed."""
        cap = self.cap
        for total in self.sums.values():
            total.zero_()
        after = partial(_add_to, self.sums, self.scopes)
        ahead = (then, 0, cap.numel) if then is not None else None
        prefetched = self.space.rows(
            cap, step, self.learners, self.whole, 0, cap.numel, ahead, after
        )
        for i in range(self.n):
            start = time.perf_counter()
            row, (parts, finite) = next(prefetched)
            self.reading += time.perf_counter() - start
            if not finite or not self.whole_scope:
                self.checked(torch.from_numpy(row), i)
            for j, ((sc, _), stream) in enumerate(zip(self.chosen, self.streams, strict=True)):
                start = time.perf_counter()
                stream.learner(i, parts[sc.name])
                self.spent[j] += time.perf_counter() - start
        prefetched.close()

    def finish(self) -> list[SchemeStep]:
        """Each stream's outcome, with its reference and compression time per learner."""
        means = {name: total.div_(self.n) for name, total in self.sums.items()}  # rows reused
        results = []
        for j, ((sc, scheme), stream) in enumerate(zip(self.chosen, self.streams, strict=True)):
            start = time.perf_counter()
            outcome = stream.finish()
            self.spent[j] += time.perf_counter() - start
            reference = scheme.reference(means[sc.name])
            results.append(SchemeStep(outcome, reference, self.spent[j] / self.n))
        return results
