"""CLT-k (ScaleCom, Chen et al. 2021, arXiv 2104.11125, docs/methods.md 4): the leader
``t mod n`` (t the recorded step) broadcasts its top-k indices; every learner
all-reduces its values at those indices. Exactly k non-zeros whatever n. Its memory is
ScaleCom's low-pass residual ``m = (1 - beta) m + beta (p - c)``."""

from __future__ import annotations

from typing import Any

import torch

from gradstat.compressors.base import Compressor, Exchange, index_dtype
from gradstat.compressors.exchange import (
    AllReduce,
    Broadcast,
    Call,
    Sent,
    SparseRow,
    Tensors,
    Transfer,
    nbytes,
)
from gradstat.compressors.memory import Memory, ResidualMemory
from gradstat.compressors.work import Work, passes, scatter, topk
from gradstat.stats.topk_sets import topk_indices


class CLTK(Compressor):
    """ScaleCom's cyclic local top-k: the leader's indices, everyone's values."""

    name = "clt-k"
    collective = "broadcast+allreduce"
    sparse = False

    def __init__(self, k: int, beta: float = 1.0) -> None:
        self.k = k
        self.beta = beta

    def decompress(self, tensors: Tensors, ctx: Any) -> torch.Tensor:
        """The values at the leader's indices (the payload); the context is the length."""
        indices, values = tensors
        return SparseRow(ctx, indices.long(), values).dense()

    def memory(self) -> Memory:
        return ResidualMemory(beta=self.beta)

    def settings(self) -> dict[str, float]:
        return {"k": self.k, "beta": self.beta}

    def exchange(self, p: torch.Tensor, call: Call) -> Exchange:
        """Broadcast of the leader's k indices, all-reduce of the k values there."""
        flat = p.reshape(-1)
        d, k = flat.numel(), self.k
        leader = call.step % call.learners
        indices = torch.zeros(k, dtype=index_dtype(d))
        if call.learner == leader:
            indices = topk_indices(flat, k).to(indices.dtype)
        indices = yield Broadcast(indices, leader)
        at = indices.long()
        values = flat[at]
        (summed,) = yield AllReduce([values])
        estimate = SparseRow(d, at, summed / call.learners)
        transfers = (Transfer("broadcast", nbytes(indices)), Transfer("allreduce", nbytes(values)))
        info = {"leader": float(leader)}
        sent = SparseRow(d, at, values)
        return Sent(sent, estimate, transfers, k, None, info, (indices, values), d)

    def work(self, numel: int, memory: Memory) -> Work:
        local = memory.work(numel) + passes(1, numel) + scatter(self.k)
        return Work(local, topk(numel, self.k), scatter(self.k), "one")


def build(ctx: Any) -> Compressor:
    return CLTK(ctx.k, beta=ctx.params["beta"])
