"""Random-k with a shared seed (Stich et al. 2018): every learner draws the same k
indices from the seed they share, so only the k values travel, by a dense all-reduce
(GRACE's ``RandomKCompressor``). The draw is seeded from (``--seed``, the recorded step,
the message): the same on every learner, and the same in a window of steps as in the
whole replay; it is work every learner does, so the replay draws once."""

from __future__ import annotations

from typing import Any

import torch

from gradstat.compressors.base import Compressor, Exchange
from gradstat.compressors.exchange import (
    AllReduce,
    Call,
    Sent,
    Shared,
    SparseRow,
    Tensors,
    Transfer,
    nbytes,
)
from gradstat.compressors.memory import Memory, ResidualMemory
from gradstat.compressors.work import Ops, Work, passes, scatter


def draw(numel: int, k: int, seed: int) -> torch.Tensor:
    """The k indices of one message's step, from the seed every learner shares."""
    return torch.randperm(numel, generator=torch.Generator().manual_seed(seed))[:k]


class RandomK(Compressor):
    """Random-k with a seed shared by all learners: k values all-reduced, no indices."""

    name = "randomk"
    collective = "allreduce"
    sparse = False

    def __init__(self, k: int) -> None:
        self.k = k

    def decompress(self, tensors: Tensors, ctx: Any) -> torch.Tensor:
        """The values at the step's indices; the context is ``(indices, numel)``."""
        indices, numel = ctx
        return SparseRow(numel, indices, tensors[0]).dense()

    def memory(self) -> Memory:
        return ResidualMemory()

    def exchange(self, p: torch.Tensor, call: Call) -> Exchange:
        flat = p.reshape(-1)
        d = flat.numel()
        indices = yield Shared(draw, (d, self.k, call.seed_of(shared=True)))
        values = flat[indices]
        (summed,) = yield AllReduce([values])
        estimate = SparseRow(d, indices, summed / call.learners)
        transfers = (Transfer("allreduce", nbytes(values)),)
        sent = SparseRow(d, indices, values)
        return Sent(sent, estimate, transfers, self.k, None, {}, (values,), (indices, d))

    def work(self, numel: int, memory: Any) -> Work:
        local = memory.work(numel) + passes(1, numel) + scatter(self.k)
        return Work(local, Ops(randperm=numel, launches=1), scatter(self.k), "one")


def build(ctx: Any) -> Compressor:
    return RandomK(ctx.k)
