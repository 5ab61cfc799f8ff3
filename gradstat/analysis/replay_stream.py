"""One replay step of one compressor, streamed learner by learner.

:meth:`Scheme.step <gradstat.compressors.registry.Scheme.step>` compresses a whole step
``g[n, d]`` at once, which holds ``n`` full rows several times over (gradients,
corrected vectors, what each learner sent). Here a step is fed one learner's row at a
time: the row is error-corrected with that learner's memory (kept in a
:mod:`~gradstat.analysis.ef_store` store: RAM or a scratch file), compressed, added to the
running aggregate and the memory is updated, so that beyond the memories themselves only
a few rows of ``d`` values are alive. The arithmetic is the same as ``Scheme.step``'s, row
by row (tests check the records against it).

Compressors that need every learner at once stay exact:

* CLT-k: the leader's corrected row is formed first (its memory is read but not yet
  updated) to pick the indices every learner then sends.
* random-k: the shared seed draws the step's indices before the first learner.
* gTop-k: each learner's local top-k (O(n k) pairs) is kept while its corrected row is
  parked in its memory row; after the tree merge a second pass zeroes what each learner
  sent.
* PowerSGD: pass 1 forms ``P = mean_i M_i Q`` (the corrected rows parked in the memory
  rows), pass 2 ``Q = mean_i M_i^T P``, pass 3 leaves ``M_i - P Q^T`` in each memory
  (and nothing for the parameters sent uncompressed).

gTop-k and PowerSGD park the corrected vector in the residual memory, which needs plain
error feedback (``beta = 1``, the only one the registry gives them).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from gradstat.analysis.ef_store import MemoryRows, RamRows, ScratchRows
from gradstat.analysis.finite import require_finite
from gradstat.analysis.topk_stream import Workspace
from gradstat.compressors.estimated import EstimatedSparsifier
from gradstat.compressors.legacy import (
    LocalCompressor,
    Payload,
    Transfer,
    index_dtype,
    sparse_payload,
)
from gradstat.compressors.memory import DGCMemory, NoMemory, ResidualMemory
from gradstat.compressors.powersgd import PowerSGD
from gradstat.compressors.quantize import SignSGD
from gradstat.compressors.registry import Scheme
from gradstat.compressors.sparse import CLTK, GTopK, RandomK, TopK, top_indices
from gradstat.stats.row_kernels import add_checked, add_squares, momentum_add, squared_norm
from gradstat.stats.topk_sets import add_then_topk
from gradstat.store import Capture, Scope

Store = RamRows | ScratchRows
ReadRow = Callable[[int], torch.Tensor]


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
    """What one step of all learners produced (the fields of ``Exchange`` a record uses,
    plus the memory norm after the step). ``estimate``: the aggregate, dense or, for
    sparsifiers, a :class:`SparseRow`."""

    estimate: torch.Tensor | SparseRow
    transfers: tuple[Transfer, ...]
    selected: list[int]
    memory_norm: float
    union: int | None = None
    gathered_bytes: float | None = None
    info: dict[str, float] = field(default_factory=dict)
    #: all-gathered sparse sets: h(c), c = 1..n, how many coordinates exactly c learners
    #: sent (the build-up curve's input, :func:`gradstat.stats.topk_sets.buildup_curve`)
    multiplicity: list[int] | None = None

    @property
    def bytes_per_learner(self) -> float:
        return sum(t.nbytes for t in self.transfers)


def _norm(row: torch.Tensor) -> float:
    """||row||_2 summed in float64 in one pass (:func:`~gradstat.stats.row_kernels.squared_norm`
    on the CPU; a whole-row ``double()`` cost 18 ms of an 8M-value step's 75)."""
    flat = row.reshape(-1)
    if flat.device.type == "cpu" and flat.dtype == torch.float32:
        return math.sqrt(squared_norm(np.ascontiguousarray(flat.numpy())))
    return float(torch.linalg.vector_norm(flat, dtype=torch.float64))


def _add_squares(p: torch.Tensor, g: torch.Tensor) -> float | None:
    """``p += g`` in place and ||p||^2 (float64) in one pass on the CPU
    (:func:`~gradstat.stats.row_kernels.add_squares`); elsewhere the add alone (None)."""
    if p.device.type == "cpu" and p.dtype == torch.float32 and g.dtype == torch.float32:
        return add_squares(p.numpy(), g.numpy())
    p.add_(g)
    return None


def _squares_left(squares: float, before: torch.Tensor, after: torch.Tensor | None = None) -> float:
    """||m||^2 of a memory ``m`` that is the row ``p`` but at some indices, from ``squares``
    = ||p||^2 found while forming ``p``: ``before`` and ``after`` are the values there
    (``after`` None: zeroed). In float64, to its rounding of ||p||^2 (a few 1e-16 of it,
    kept from going below 0); it saves a pass over the new memory."""
    squares -= float(before.double().square().sum())
    if after is not None:
        squares += float(after.double().square().sum())
    return max(squares, 0.0)


class Memories:
    """The error-feedback memories of one scheme, one row per learner (see the module
    docstring): residual ``m``, DGC's ``u`` and ``v``, or none."""

    def __init__(self, memory, learners: int, numel: int, rows: MemoryRows) -> None:
        self.kind = memory
        if isinstance(memory, ResidualMemory):
            self.m = rows.new(learners, numel)
        elif isinstance(memory, DGCMemory):
            self.u, self.v = rows.new(learners, numel), rows.new(learners, numel)
        elif not isinstance(memory, NoMemory):
            raise TypeError(f"no streamed replay for {type(memory).__name__}")
        self.norms: list[float] = []

    def peek(self, learner: int, g: torch.Tensor) -> torch.Tensor:
        """The corrected row ``p`` of ``learner`` without updating anything (CLT-k leader)."""
        if isinstance(self.kind, ResidualMemory):
            return g + self.m.load(learner)
        if isinstance(self.kind, DGCMemory):
            u = self.u.load(learner) * self.kind.momentum + g
            return self.v.load(learner) + u
        return g

    def compensate(self, learner: int, g: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        """``p`` for the compressor, and the state :meth:`update` needs."""
        if isinstance(self.kind, ResidualMemory):
            m = self.m.load(learner)
            return g + m, (m,)
        if isinstance(self.kind, DGCMemory):
            u, v = self.u.load(learner), self.v.load(learner)
            counted = None  # the new v's (zeros, float64 sum of squares), found on the way
            if u.device.type == "cpu":  # one pass, the same bits
                counted = momentum_add(u.numpy(), v.numpy(), g.numpy(), self.kind.momentum)
            else:
                u.mul_(self.kind.momentum).add_(g)
                v.add_(u)
            return v, (u, v, counted)
        return g, ()

    @property
    def plain_residual(self) -> bool:
        """A residual memory with beta = 1 (``m = p - sent``, nothing of the old ``m``)."""
        return isinstance(self.kind, ResidualMemory) and self.kind.beta == 1.0

    def keep(self, learner: int, m: torch.Tensor, squared_norm: float | None = None) -> None:
        """Store a residual row formed in place (``plain_residual``); ``squared_norm``:
        its ||m||^2 when the caller found it on the way (else a pass over ``m``)."""
        self.m.save(learner, m)
        self.norms.append(_norm(m) if squared_norm is None else math.sqrt(squared_norm))

    def update(self, learner: int, p: torch.Tensor, sent: torch.Tensor, state: tuple) -> None:
        """Keep what was not sent (``ResidualMemory.update`` / ``DGCMemory.update``)."""
        if isinstance(self.kind, ResidualMemory):
            (m,) = state
            beta = self.kind.beta
            if beta == 1.0:
                torch.sub(p, sent, out=m)
            else:
                m.mul_(1.0 - beta).add_(p - sent, alpha=beta)
            self.m.save(learner, m)
            self.norms.append(_norm(m))
        elif isinstance(self.kind, DGCMemory):
            u, v, _ = state
            mask = sent != 0
            torch.sub(p, sent, out=v)
            v.masked_fill_(mask, 0.0)
            u.masked_fill_(mask, 0.0)
            self.u.save(learner, u)
            self.v.save(learner, v)
            self.norms.append(_norm(v))
        else:
            self.norms.append(0.0)

    def mask_sent(
        self, learner: int, sent: torch.Tensor, state: tuple, values: torch.Tensor
    ) -> None:
        """DGC's update for a sparse payload: ``u`` and ``v`` zeroed at ``sent``, the
        indices of the non-zero ``values`` sent. ``v`` is the corrected row itself, so
        ``v - sent`` differs from ``v`` only there, where factor masking zeroes it:
        the same numbers as :meth:`update` with the dense ``sent``. The new norm is
        ||v||^2 less the squares sent, when :meth:`compensate` found ||v||^2 (float64:
        within a few 1e-16 of a pass over the new ``v``, which it saves)."""
        u, v, counted = state
        v.index_fill_(0, sent, 0.0)
        u.index_fill_(0, sent, 0.0)
        self.u.save(learner, u)
        self.v.save(learner, v)
        if counted is None:
            self.norms.append(_norm(v))
        else:
            self.norms.append(math.sqrt(_squares_left(counted[1], values)))

    def park(self, learner: int, p: torch.Tensor) -> None:
        """Keep the corrected row in the memory row until a later pass (plain EF only)."""
        self.m.save(learner, p)

    def norm(self) -> float:
        """Mean over learners of ``||memory_i||`` after this step (then starts afresh)."""
        norms, self.norms = self.norms, []
        return sum(norms) / len(norms) if norms else 0.0


class StreamedScheme:
    """A scheme (compressor + memory) fed one learner's row at a time; see :func:`streamed`."""

    def __init__(self, scheme: Scheme, learners: int, numel: int, rows: MemoryRows) -> None:
        self.scheme = scheme
        self.compressor = scheme.compressor
        self.n, self.d = learners, numel
        self.memories = Memories(scheme.memory, learners, numel, rows)

    def begin(self, read_row: ReadRow) -> None:
        """Start a step; ``read_row(i)`` reads learner i's row where a method needs it early."""

    def learner(self, i: int, g: torch.Tensor) -> None:
        """Feed learner i's gradient row (learners in order 0..n-1)."""
        raise NotImplementedError

    def finish(self) -> StepOutcome:
        """End the step: the aggregate and what travelled."""
        raise NotImplementedError


class LocalStream(StreamedScheme):
    """Compressors that encode each learner alone (GRACE compress/decompress)."""

    compressor: LocalCompressor
    total: torch.Tensor | None = None

    @property
    def sparse_only(self) -> bool:
        """Every learner's payload goes in sparse (:meth:`_add_sparse`): the aggregate
        is a :class:`SparseRow`, with no dense sum."""
        memories = self.memories
        return self.compressor.sparse and (
            memories.plain_residual or isinstance(memories.kind, DGCMemory)
        )

    def begin(self, read_row: ReadRow) -> None:
        if self.sparse_only:  # no dense sum
            self.total = None
        elif self.total is None:
            self.total = torch.zeros(self.d)
        else:  # the sum's row is kept from step to step (a fresh one costs its page faults)
            self.total.zero_()
        self.majority = isinstance(self.compressor, SignSGD) and self.compressor.majority
        self.scales: list[torch.Tensor] = []
        self.sizes: list[int] = []
        self.selected: list[int] = []
        self.indices: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []  # of the sparse payloads, in learner order
        self.infos: list[dict[str, float]] = []

    def learner(self, i: int, g: torch.Tensor) -> None:
        if self.sparse_only:  # the one test of which path a learner takes
            if self.memories.plain_residual:
                self._sparse_learner(i, g)
            else:
                self._sparse_dgc_learner(i, g)
            return
        p, state = self.memories.compensate(i, g)
        payload = self.compressor.compress(p, i)
        sent = self.compressor.decompress(payload)
        if self.majority:  # SignSGD.aggregate, one row at a time
            self.total += torch.sign(sent)
            self.scales.append(sent.abs().mean())
        else:
            self.total += sent
        self._note(payload)
        self.memories.update(i, p, sent, state)

    def _sparse_learner(self, i: int, g: torch.Tensor) -> None:
        """A sparse payload with plain error feedback (beta = 1), without dense copies:
        ``p = g + m`` is formed in the memory row, the payload's values are kept for the
        sparse aggregate (:meth:`finish`) and subtracted from ``p`` at their indices,
        leaving ``m = p - sent``. The same numbers as decompressing to a dense ``sent`` (adding
        or subtracting the zeros elsewhere changes nothing); a replay of top-k on
        4 x 8M values spent half its time on those dense rows. Top-k forms ``p`` and
        finds its candidates and the new memory's norm (``p`` outside the k sent) in one
        pass (:func:`add_then_topk`); the others form ``p`` with ||p||^2 in one pass
        (:func:`_add_squares`), the norm following from it and the values changed at
        the indices sent."""
        p = self.memories.m.load(i)
        if isinstance(self.compressor, TopK):
            chosen, squared_norm = add_then_topk(p, g, self.compressor.k)
            index, values = self._add_sparse(sparse_payload(p, chosen))
            p.index_add_(0, index, values, alpha=-1)  # indices are distinct: p[index] -= values
            self.memories.keep(i, p, squared_norm)
            return
        squared_norm = _add_squares(p, g)
        index, values = self._add_sparse(self.compressor.compress(p, i))
        p_at = p[index]
        p.index_add_(0, index, values, alpha=-1)  # indices are distinct: p[index] -= values
        if squared_norm is not None:  # ||m||^2 from ||p||^2 and the values changed
            squared_norm = _squares_left(squared_norm, p_at, p[index])
        self.memories.keep(i, p, squared_norm)

    def _sparse_dgc_learner(self, i: int, g: torch.Tensor) -> None:
        """A sparse payload with DGC's memories, without dense copies: the compressor
        selects from ``v``, the payload's values are kept for the sparse aggregate
        (:meth:`finish`) and :meth:`Memories.mask_sent` zeroes ``u`` and ``v`` where
        non-zero values were sent. A dense ``sent``, its mask and two masked fills were
        half of a DGC step."""
        v, state = self.memories.compensate(i, g)
        counted = state[2]
        if counted is not None and isinstance(self.compressor, EstimatedSparsifier):
            payload = self.compressor.compress(v, i, nonzeros=v.numel() - counted[0])
        else:
            payload = self.compressor.compress(v, i)
        index, values = self._add_sparse(payload)
        self.memories.mask_sent(i, index[values != 0], state, values)

    def _add_sparse(self, payload: Payload) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep a sparse payload's values for the aggregate (:meth:`finish`), note the
        payload, and return (indices as int64, values)."""
        indices, values = payload.tensors
        self.values.append(values)
        self._note(payload)
        return indices.long(), values

    def _note(self, payload: Payload) -> None:
        """What the cost model and the build-up count need of a learner's payload."""
        self.sizes.append(payload.nbytes)
        self.selected.append(payload.selected)
        self.infos.append(payload.info)
        if self.compressor.sparse:
            self.indices.append(payload.tensors[0])

    def finish(self) -> StepOutcome:
        union = multiplicity = None
        if self.sparse_only:
            estimate, holders = self._sparse_mean()
        elif self.majority:
            estimate = torch.sign(self.total) * torch.stack(self.scales).mean()
        else:  # in place: the sum's row is zeroed when the next step begins
            estimate = self.total.div_(self.n)
        if self.indices:
            if not self.sparse_only:
                _, holders = torch.unique(torch.cat(self.indices), return_counts=True)
            union = int(holders.numel())
            multiplicity = torch.bincount(holders, minlength=self.n + 1)[1:].tolist()
        collective = self.compressor.collective
        info = {
            key: sum(info[key] for info in self.infos) / len(self.infos) for key in self.infos[0]
        }
        return StepOutcome(
            estimate=estimate,
            transfers=(Transfer(collective, sum(self.sizes) / len(self.sizes)),),
            selected=self.selected,
            memory_norm=self.memories.norm(),
            union=union,
            gathered_bytes=float(sum(self.sizes)) if collective == "allgather" else None,
            info=info,
            multiplicity=multiplicity if collective == "allgather" else None,
        )

    def _sparse_mean(self) -> tuple[SparseRow, torch.Tensor]:
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


class SharedIndexStream(StreamedScheme):
    """Random-k (indices from the shared seed) and CLT-k (the leader's top-k): every learner
    sends its values at the same k indices, all-reduced."""

    compressor: RandomK | CLTK

    def begin(self, read_row: ReadRow) -> None:
        k = self.compressor.k
        self.info: dict[str, float] = {}
        #: (leader, its corrected row, ||row||^2) when formed in its memory row
        self._formed: tuple[int, torch.Tensor, float | None] | None = None
        if isinstance(self.compressor, RandomK):
            generator = self.compressor.generator
            self.indices = torch.randperm(self.d, generator=generator)[:k]
        else:
            leader = self.compressor.step_count % self.n
            self.compressor.step_count += 1
            self.indices = top_indices(self._leader_row(leader, read_row(leader)), k)
            self.info = {"leader": leader}
        self.values = torch.zeros(k)

    def _leader_row(self, leader: int, g: torch.Tensor) -> torch.Tensor:
        """CLT-k's leader's corrected row, whose top-k every learner sends. With plain
        error feedback it is formed in the leader's memory row, once, and kept for the
        leader's turn (:meth:`learner`): a separate ``m + g`` was one more row (128 MB
        at 32M values) in every step."""
        if not self.memories.plain_residual:
            return self.memories.peek(leader, g)
        p = self.memories.m.load(leader)
        self._formed = (leader, p, _add_squares(p, g))
        return p

    def learner(self, i: int, g: torch.Tensor) -> None:
        if self.memories.plain_residual:  # p = m + g in the memory row; m = p - sent there
            if self._formed is not None and self._formed[0] == i:  # formed in begin
                _, p, squared_norm = self._formed
                self._formed = None
            else:
                p = self.memories.m.load(i)
                squared_norm = _add_squares(p, g)
            p_at = p[self.indices]
            self.values += p_at
            p[self.indices] = 0.0  # p - p where sent, p elsewhere: the same bits
            if squared_norm is not None:  # ||m||^2: ||p||^2 less the squares sent
                squared_norm = _squares_left(squared_norm, p_at)
            self.memories.keep(i, p, squared_norm)
            return
        p, state = self.memories.compensate(i, g)
        values = p[self.indices]
        self.values += values
        sent = torch.zeros(self.d)
        sent[self.indices] = values
        self.memories.update(i, p, sent, state)

    def finish(self) -> StepOutcome:
        k = self.compressor.k
        estimate = SparseRow(self.d, self.indices, self.values / self.n)
        transfers = (Transfer("allreduce", k * 4),)
        if isinstance(self.compressor, CLTK):
            index_bytes = k * torch.empty(0, dtype=index_dtype(self.d)).element_size()
            transfers = (Transfer("broadcast", index_bytes), *transfers)
        return StepOutcome(
            estimate=estimate,
            transfers=transfers,
            selected=[k] * self.n,
            memory_norm=self.memories.norm(),
            union=k,
            info=self.info,
        )


class GTopKStream(StreamedScheme):
    """gTop-k: local top-k now, the tree merge and what each learner sent at the end."""

    compressor: GTopK

    def begin(self, read_row: ReadRow) -> None:
        self.local: list[tuple[torch.Tensor, torch.Tensor]] = []

    def learner(self, i: int, g: torch.Tensor) -> None:
        p, _ = self.memories.compensate(i, g)
        indices = top_indices(p, self.compressor.k)
        self.local.append((indices, p[indices]))
        self.memories.park(i, p)

    def finish(self) -> StepOutcome:
        k = self.compressor.k
        surviving, final = self.compressor.tree(self.local)
        total = torch.zeros(self.d)
        store = self.memories.m
        for i, indices in enumerate(surviving):
            p = store.load(i)
            total[indices] += p[indices]
            p[indices] = 0.0
            store.save(i, p)
            self.memories.norms.append(_norm(p))
        pair_bytes = k * (torch.empty(0, dtype=index_dtype(self.d)).element_size() + 4)
        return StepOutcome(
            estimate=total / self.n,
            transfers=(Transfer("reduce", pair_bytes), Transfer("broadcast", pair_bytes)),
            selected=[k] * self.n,
            memory_norm=self.memories.norm(),
            union=int(final.numel()),
        )


class PowerSGDStream(StreamedScheme):
    """PowerSGD in three passes over the learners (see the module docstring)."""

    compressor: PowerSGD

    def begin(self, read_row: ReadRow) -> None:
        c = self.compressor
        if self.d != c.numel:
            raise ValueError(f"powersgd was planned for {c.numel} elements, got {self.d}")
        if c.q is None:
            c.q = c._initial_q(torch.float32)
        self.dense = torch.zeros(self.d)
        self.p = [torch.zeros(rows, c.rank) for _, rows, _ in c.matrices]

    def _matrix(self, row: torch.Tensor, j: int) -> torch.Tensor:
        offset, rows, cols = self.compressor.matrices[j]
        return row[offset : offset + rows * cols].view(rows, cols)

    def learner(self, i: int, g: torch.Tensor) -> None:
        p, _ = self.memories.compensate(i, g)
        for offset, numel in self.compressor.dense:
            self.dense[offset : offset + numel] += p[offset : offset + numel]
        for j, q in enumerate(self.compressor.q or []):
            self.p[j] += self._matrix(p, j) @ q
        self.memories.park(i, p)

    def finish(self) -> StepOutcome:
        c, n, store = self.compressor, self.n, self.memories.m
        assert c.q is not None
        ps = [torch.linalg.qr(p / n, mode="reduced").Q for p in self.p]
        qs = [torch.zeros_like(q) for q in c.q]
        for i in range(n):
            row = store.load(i)
            for j, p in enumerate(ps):
                qs[j] += self._matrix(row, j).T @ p
        estimate = self.dense / n
        for j, (offset, rows, cols) in enumerate(c.matrices):
            c.q[j] = qs[j] / n
            estimate[offset : offset + rows * cols] = (ps[j] @ c.q[j].T).reshape(-1)
        for i in range(n):
            row = store.load(i)
            torch.sub(row, estimate, out=row)
            for offset, numel in c.dense:  # sent as they were: no residual (PowerSGD)
                row[offset : offset + numel] = 0.0
            store.save(i, row)
            self.memories.norms.append(_norm(row))
        dense = sum(numel for _, numel in c.dense)
        first = (dense + c.rank * sum(rows for _, rows, _ in c.matrices)) * 4
        transfers = [Transfer("allreduce", first)]
        if c.matrices:
            second = c.rank * sum(cols for _, _, cols in c.matrices) * 4
            transfers.append(Transfer("allreduce", second))
        return StepOutcome(
            estimate=estimate,
            transfers=tuple(transfers),
            selected=[self.d] * n,
            memory_norm=self.memories.norm(),
        )


def streamed(scheme: Scheme, learners: int, numel: int, rows: MemoryRows) -> StreamedScheme:
    """The streamed form of ``scheme`` for ``learners`` rows of ``numel`` values."""
    compressor = scheme.compressor
    if isinstance(compressor, LocalCompressor):
        return LocalStream(scheme, learners, numel, rows)
    if isinstance(compressor, (RandomK, CLTK)):
        return SharedIndexStream(scheme, learners, numel, rows)
    if isinstance(compressor, (GTopK, PowerSGD)):
        beta = getattr(scheme.memory, "beta", 1.0)
        if not math.isclose(beta, 1.0):
            raise ValueError(f"{scheme.spec.label}: a streamed replay needs beta = 1")
        stream = GTopKStream if isinstance(compressor, GTopK) else PowerSGDStream
        return stream(scheme, learners, numel, rows)
    raise TypeError(f"no streamed replay for {type(compressor).__name__}")


def memory_rows_needed(scheme: Scheme) -> int:
    """Rows per learner the scheme's error-feedback memory keeps."""
    return {ResidualMemory: 1, DGCMemory: 2}.get(type(scheme.memory), 0)


def memory_bytes_needed(schemes: Sequence[Scheme], learners: int, numel: Sequence[int]) -> int:
    """Bytes the error-feedback memories of ``schemes`` (scope sizes ``numel``) take."""
    return sum(
        memory_rows_needed(s) * learners * d * 4 for s, d in zip(schemes, numel, strict=True)
    )


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
    n = len(learners)
    scopes = list({sc.name: sc for sc, _ in chosen}.values())
    whole = Scope("model", ((0, cap.numel),))
    whole_scope = any(sc.numel == cap.numel for sc in scopes)  # its check covers every value
    space = Workspace()  # the next learner's row is read while this one is replayed
    space.ensure(cap.numel, torch.device("cpu"), with_mean=False)
    sums = {sc.name: torch.zeros(sc.numel) for sc in scopes}
    next_step = dict(itertools.pairwise(steps))
    try:
        with MemoryRows(scratch) as rows:
            streams = [streamed(scheme, n, sc.numel, rows) for sc, scheme in chosen]
            for step in steps:
                spent = [0.0] * len(streams)
                reading = 0.0

                def checked(g: torch.Tensor, i: int, step: int = step) -> torch.Tensor:
                    if not math.isfinite(float(g.sum())):  # one cheap pass; then find the culprit
                        require_finite(step, g[None], [learners[i]], "replay")
                    return g

                def read_row(i: int, step: int = step) -> torch.Tensor:
                    nonlocal reading
                    start = time.perf_counter()
                    g = checked(torch.from_numpy(cap.read_row(step, learners[i])), i)
                    reading += time.perf_counter() - start
                    return g

                for j, ((sc, _), stream) in enumerate(zip(chosen, streams, strict=True)):
                    start, before = time.perf_counter(), reading
                    stream.begin(lambda i, sc=sc: sc.take(read_row(i)))
                    spent[j] += time.perf_counter() - start - (reading - before)
                for total in sums.values():
                    total.zero_()
                # the reading thread adds each row to the reference sums, in learner order,
                # and reads the next step's first row while this step's last is replayed
                after = partial(_add_to, sums, scopes)
                then = (next_step[step], 0, cap.numel) if step in next_step else None
                prefetched = space.rows(cap, step, learners, whole, 0, cap.numel, then, after)
                for i in range(n):
                    start = time.perf_counter()
                    row, (parts, finite) = next(prefetched)
                    reading += time.perf_counter() - start
                    g = torch.from_numpy(row)
                    if not finite or not whole_scope:
                        checked(g, i)
                    for j, ((sc, _), stream) in enumerate(zip(chosen, streams, strict=True)):
                        start = time.perf_counter()
                        stream.learner(i, parts[sc.name])
                        spent[j] += time.perf_counter() - start
                prefetched.close()
                means = {name: total.div_(n) for name, total in sums.items()}  # rows reused
                results = []
                for j, ((sc, scheme), stream) in enumerate(zip(chosen, streams, strict=True)):
                    start = time.perf_counter()
                    outcome = stream.finish()
                    spent[j] += time.perf_counter() - start
                    reference = scheme.reference(means[sc.name])
                    results.append(SchemeStep(outcome, reference, spent[j] / n))
                yield step, results
    finally:
        space.release()
