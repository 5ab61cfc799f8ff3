"""PowerSGD: rank-r power iteration per matrix with a warm-started Q.

Vogels, Karimireddy and Jaggi 2019 (arXiv 1905.13727), Algorithm 1, as in PyTorch's
``powerSGD_hook`` (docs/methods.md 4): each >= 2-D parameter of a message is viewed as a
matrix ``M`` of shape ``(shape[0], prod(shape[1:]))``; ``P = M Q``; all-reduce ``P``;
orthogonalise it; ``Q = M^T P``; all-reduce ``Q``; every learner ends with ``M_hat = P
Q^T`` (the same for all), and error feedback keeps ``M_i - M_hat``. ``Q`` starts from a
seeded normal draw shared by all learners and is reused the next step (warm start). A
matrix is compressed only if ``(a + b) r < a b / 2``; vectors and small matrices travel
uncompressed in the first all-reduce and keep no error-feedback residual (each learner
sent exactly its own values, as in PyTorch's hook and GRACE). Its rate is set by the
rank, not by ``--ratios``. The orthogonalisation and ``P Q^T`` are the same on every
learner: the replay computes them once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gradstat.compressors.base import Compressor, Exchange
from gradstat.compressors.exchange import AllReduce, Call, Sent, Shared, Tensors, Transfer, nbytes
from gradstat.compressors.memory import Memory, ResidualMemory
from gradstat.compressors.work import F, Ops, Work, passes
from gradstat.errors import UsageError


def matrices_of(shapes: Sequence[tuple[int, ...]], rank: int) -> tuple[list, list]:
    """``(matrices, dense)`` of parameters laid end to end: ``(offset, rows, cols)`` of
    each matrix PowerSGD compresses at ``rank``, ``(offset, numel)`` of the others."""
    matrices, dense, offset = [], [], 0
    for shape in shapes:
        numel = math.prod(shape)
        rows = shape[0] if shape else 1
        cols = numel // rows if rows else 0
        if len(shape) >= 2 and (rows + cols) * rank < rows * cols / 2:
            matrices.append((offset, rows, cols))
        else:
            dense.append((offset, numel))
        offset += numel
    return matrices, dense


class PowerSGD(Compressor):
    """Rank-``rank`` PowerSGD over the parameters ``shapes`` that tile the message."""

    name = "powersgd"
    collective = "allreduce"
    sparse = False

    def __init__(self, shapes: Sequence[tuple[int, ...]], rank: int = 4, seed: int = 0) -> None:
        if rank < 1:
            raise ValueError(f"powersgd rank must be >= 1, got {rank}")
        self.rank, self.seed = rank, seed
        self.matrices, self.dense = matrices_of(shapes, rank)
        self.numel = sum(math.prod(shape) for shape in shapes)
        self.q: list[torch.Tensor] | None = None

    def warm_q(self, numel: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
        """The ``Q`` of each matrix for this step: last step's (warm start), or at the first
        step a seeded normal draw every learner shares. Checks the message's size."""
        if numel != self.numel:
            raise ValueError(f"powersgd was planned for {self.numel} elements, got {numel}")
        if self.q is None:
            generator = torch.Generator().manual_seed(self.seed)
            self.q = [
                torch.randn(cols, self.rank, generator=generator).to(dtype)
                for _, _, cols in self.matrices
            ]
        return self.q

    def decompress(self, tensors: Tensors, ctx: Any) -> torch.Tensor:
        """What a learner sent: its context holds it (PowerSGD's payloads are P and Q)."""
        return ctx

    def memory(self) -> Memory:
        return ResidualMemory()

    def settings(self) -> dict[str, float]:
        return {"rank": self.rank, "matrices": len(self.matrices)}

    def orthogonal(self, first: torch.Tensor, n: int) -> list[torch.Tensor]:
        """Each matrix's ``P``: its part of the all-reduced ``[dense, P]``, averaged, QR'd."""
        position, ps = sum(numel for _, numel in self.dense), []
        for _, a, _ in self.matrices:
            ps.append(torch.linalg.qr(first[position : position + a * self.rank].view(a, -1) / n).Q)
            position += a * self.rank
        return ps

    def estimate(self, first, ps, second, n: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The aggregate every learner ends with, and each matrix's next warm ``Q``."""
        estimate = torch.zeros(self.numel, dtype=first.dtype)
        position = 0
        for offset, numel in self.dense:
            estimate[offset : offset + numel] = first[position : position + numel] / n
            position += numel
        qs, position = [], 0
        for (offset, a, b), pm in zip(self.matrices, ps, strict=True):
            qs.append(second[position : position + b * self.rank].view(b, -1) / n)
            position += b * self.rank
            estimate[offset : offset + a * b] = (pm @ qs[-1].T).reshape(-1)
        return estimate, qs

    def exchange(self, p: torch.Tensor, call: Call) -> Exchange:
        """The all-reduce of ``[uncompressed values, P]``, the orthogonalisation, the
        all-reduce of ``Q``."""
        flat, n = p.reshape(-1), call.learners
        q = self.warm_q(flat.numel(), flat.dtype)
        dense = [flat[o : o + k] for o, k in self.dense]
        matrices = [flat[o : o + a * b].view(a, b) for o, a, b in self.matrices]
        first = torch.cat(dense + [(m @ qj).reshape(-1) for m, qj in zip(matrices, q, strict=True)])
        payload = [first]
        (first,) = yield AllReduce([first])
        ps = yield Shared(self.orthogonal, (first, n))
        second = torch.zeros(0)
        if matrices:
            second = torch.cat([(m.T @ pm).reshape(-1) for m, pm in zip(matrices, ps, strict=True)])
            payload.append(second)
            (second,) = yield AllReduce([second])
        estimate, self.q = yield Shared(self.estimate, (first, ps, second, n))
        sent = estimate.clone()
        for offset, numel in self.dense:  # sent as they were: no residual (PowerSGD)
            sent[offset : offset + numel] = flat[offset : offset + numel]
        transfers = tuple(Transfer("allreduce", nbytes(t)) for t in payload)
        return Sent(sent, estimate, transfers, flat.numel(), None, {}, payload, sent)

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
        return Work(local, shared, Ops(), "one")


def fits(plan: Any, params: Mapping[str, float]) -> None:
    """Refuse a plan with no matrix PowerSGD compresses at its rank."""
    rank = int(params["rank"])
    if not any(matrices_of(m.shapes, rank)[0] for m in plan.messages if not m.dense):
        raise UsageError(
            f"powersgd at rank {rank} compresses no parameter of this scope (needs a "
            "matrix with (rows + cols) * rank < rows * cols / 2)"
        )


def build(ctx: Any) -> Compressor:
    return PowerSGD(ctx.shapes, rank=int(ctx.params["rank"]), seed=ctx.seed)
