"""PowerSGD: rank-r power iteration per matrix with a warm-started Q.

Vogels, Karimireddy and Jaggi 2019 (arXiv 1905.13727), Algorithm 1, as in PyTorch's
``powerSGD_hook`` (docs/methods.md 4): each >= 2-D parameter is viewed as a matrix
``M`` of shape ``(shape[0], prod(shape[1:]))``; ``P = M Q``; all-reduce ``P``;
orthogonalise it; ``Q = M^T P``; all-reduce ``Q``; every learner ends with
``M_hat = P Q^T`` (the same for all), and error feedback keeps ``M_i - M_hat``. ``Q``
starts from a seeded normal draw shared by all learners and is reused the next step
(warm start). A matrix is compressed only if ``(a + b) r < a b / 2``; vectors and small
matrices travel uncompressed in the first all-reduce and keep no error-feedback residual
(each learner sent exactly its own values, as in PyTorch's hook and GRACE). Its rate is
set by the rank, not by ``--ratios``.

Replay (:class:`PowerSGDStream`): pass 1 forms ``P = mean_i M_i Q`` (the corrected rows
parked in the memory rows), pass 2 ``Q = mean_i M_i^T P``, pass 3 leaves ``M_i - P Q^T``
in each memory (and nothing for the parameters sent uncompressed). Training
(:meth:`PowerSGD.online`): the all-reduce of ``[uncompressed values, P]``,
orthogonalisation, the all-reduce of ``Q``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from gradstat.compressors.base import Compressor
from gradstat.compressors.communicator import Communicator
from gradstat.compressors.exchange import OnlineStep, StepOutcome, Stream, Transfer, nbytes
from gradstat.compressors.memory import Memory, row_norm
from gradstat.compressors.work import F, Ops, Work, passes
from gradstat.errors import UsageError


class PowerSGD(Compressor):
    """Rank-``rank`` PowerSGD over the parameters ``shapes`` that tile the flat vector."""

    name = "powersgd"
    collective = "allreduce"
    sparse = False

    def __init__(self, shapes: Sequence[tuple[int, ...]], rank: int = 4, seed: int = 0) -> None:
        if rank < 1:
            raise ValueError(f"powersgd rank must be >= 1, got {rank}")
        self.rank = rank
        self.seed = seed
        self.matrices: list[tuple[int, int, int]] = []  # (offset, rows, cols)
        self.dense: list[tuple[int, int]] = []  # (offset, numel)
        offset = 0
        for shape in shapes:
            numel = math.prod(shape)
            if len(shape) >= 2:
                rows, cols = shape[0], numel // shape[0]
                if (rows + cols) * rank < rows * cols / 2:
                    self.matrices.append((offset, rows, cols))
                    offset += numel
                    continue
            self.dense.append((offset, numel))
            offset += numel
        self.numel = offset
        self.q: list[torch.Tensor] | None = None

    def warm_q(self, numel: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
        """The ``Q`` of each matrix for this step: last step's (warm start), or at the first
        step a seeded normal draw every learner shares. Checks the scope's size."""
        if numel != self.numel:
            raise ValueError(f"powersgd was planned for {self.numel} elements, got {numel}")
        if self.q is None:
            generator = torch.Generator().manual_seed(self.seed)
            self.q = [
                torch.randn(cols, self.rank, generator=generator).to(dtype)
                for _, _, cols in self.matrices
            ]
        return self.q

    def transfers(self, size: int = 4) -> tuple[Transfer, ...]:
        """The all-reduce of ``[uncompressed values, P]`` and that of ``Q`` (values of
        ``size`` bytes)."""
        dense = sum(numel for _, numel in self.dense)
        first = (dense + self.rank * sum(rows for _, rows, _ in self.matrices)) * size
        transfers = [Transfer("allreduce", first)]
        if self.matrices:
            second = self.rank * sum(cols for _, _, cols in self.matrices) * size
            transfers.append(Transfer("allreduce", second))
        return tuple(transfers)

    def settings(self) -> dict[str, float]:
        return {"rank": self.rank, "matrices": len(self.matrices)}

    def stream(self, scheme: Any, name: str, learners: int, numel: int) -> Stream:
        return PowerSGDStream(scheme, learners, numel)

    def online(self, p: torch.Tensor, name: str, comm: Communicator) -> OnlineStep:
        return _online(self, p, comm)

    def work(self, numel: int, memory: Memory) -> Work:
        """Per matrix a x b at rank r: P = M Q and Q = M^T P (4abr FLOP, M read twice)
        per learner; QR of P (about 4 a r^2), M_hat = P Q^T (2abr) and copying it into
        the estimate (3 passes) by everyone in training, once in the replay."""
        r = self.rank
        local, shared = memory.work(numel), passes(1, numel)
        for _, a, b in self.matrices:
            local += Ops(mm_flops=4 * a * b * r, mm_bytes=2 * F * a * b, launches=4)
            shared += Ops(mm_flops=2 * a * b * r + 4 * a * r * r, bytes=3 * F * a * b, launches=6)
        for _, n in self.dense:
            shared += passes(3, n)
        return Work(local, shared, Ops(), Ops(), "one")


class PowerSGDStream(Stream):
    """PowerSGD in three passes over the learners (see the module docstring)."""

    def __init__(self, scheme: Any, learners: int, numel: int) -> None:
        self.compressor, self.memory = scheme.compressor, scheme.memory
        self.n, self.d = learners, numel

    def begin(self, read_row: Any) -> None:
        c = self.compressor
        self.q = c.warm_q(self.d)
        self.dense = torch.zeros(self.d)
        self.p = [torch.zeros(rows, c.rank) for _, rows, _ in c.matrices]

    def _matrix(self, row: torch.Tensor, j: int) -> torch.Tensor:
        offset, rows, cols = self.compressor.matrices[j]
        return row[offset : offset + rows * cols].view(rows, cols)

    def learner(self, i: int, g: torch.Tensor) -> None:
        p, _ = self.memory.compensate(i, g)
        for offset, numel in self.compressor.dense:
            self.dense[offset : offset + numel] += p[offset : offset + numel]
        for j, q in enumerate(self.q):
            self.p[j] += self._matrix(p, j) @ q
        self.memory.park(i, p)

    def finish(self) -> StepOutcome:
        c, n, store = self.compressor, self.n, self.memory.m
        ps = [torch.linalg.qr(p / n, mode="reduced").Q for p in self.p]
        qs = [torch.zeros_like(q) for q in self.q]
        for i in range(n):
            row = store.load(i)
            for j, p in enumerate(ps):
                qs[j] += self._matrix(row, j).T @ p
        estimate = self.dense / n
        for j, (offset, rows, cols) in enumerate(c.matrices):
            self.q[j] = qs[j] / n
            estimate[offset : offset + rows * cols] = (ps[j] @ self.q[j].T).reshape(-1)
        for i in range(n):
            row = store.load(i)
            torch.sub(row, estimate, out=row)
            for offset, numel in c.dense:  # sent as they were: no residual (PowerSGD)
                row[offset : offset + numel] = 0.0
            store.save(i, row)
            self.memory.norms.append(row_norm(row))
        return StepOutcome(
            estimate=estimate,
            transfers=c.transfers(),
            selected=[self.d] * n,
            memory_norm=self.memory.norm(),
        )


def _online(c: PowerSGD, p: torch.Tensor, comm: Communicator) -> OnlineStep:
    """PowerSGD's two all-reduces, with the replay's matrices, warm start and residual
    rule (uncompressed parameters are sent as they are)."""
    world, d, r = comm.size, p.numel(), c.rank
    q = c.warm_q(d, p.dtype)
    dense = [p[offset : offset + numel] for offset, numel in c.dense]
    matrices = [p[o : o + a * b].view(a, b) for o, a, b in c.matrices]
    first = torch.cat(dense + [(m @ qj).reshape(-1) for m, qj in zip(matrices, q, strict=True)])
    transfers = [Transfer("allreduce", nbytes(first))]
    comm.allreduce(first)
    first /= world
    estimate = torch.zeros_like(p)
    position = 0
    for offset, numel in c.dense:
        estimate[offset : offset + numel] = first[position : position + numel]
        position += numel
    ps = []
    for _, a, _ in c.matrices:
        ps.append(torch.linalg.qr(first[position : position + a * r].view(a, r)).Q)
        position += a * r
    if matrices:
        second = torch.cat([(m.T @ pm).reshape(-1) for m, pm in zip(matrices, ps, strict=True)])
        transfers.append(Transfer("allreduce", nbytes(second)))
        comm.allreduce(second)
        second /= world
        position = 0
        for j, ((offset, a, b), pm) in enumerate(zip(c.matrices, ps, strict=True)):
            q[j] = second[position : position + b * r].view(b, r).clone()
            position += b * r
            estimate[offset : offset + a * b] = (pm @ q[j].T).reshape(-1)
    sent = estimate.clone()
    for offset, numel in c.dense:
        sent[offset : offset + numel] = p[offset : offset + numel]
    return OnlineStep(sent, estimate, tuple(transfers), d)


def build(ctx: Any) -> Compressor:
    compressor = PowerSGD(ctx.shapes, rank=int(ctx.params["rank"]), seed=ctx.seed)
    if not compressor.matrices:
        raise UsageError(
            f"powersgd at rank {int(ctx.params['rank'])} compresses no parameter of this "
            "scope (needs a matrix with (rows + cols) * rank < rows * cols / 2)"
        )
    return compressor
