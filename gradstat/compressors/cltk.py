"""CLT-k (ScaleCom, Chen et al. 2021, arXiv 2104.11125, docs/methods.md 4): the leader
``t mod n`` broadcasts its top-k indices; every learner all-reduces its values at those
indices. Exactly k non-zeros whatever n. Its memory is ScaleCom's low-pass residual
``m = (1 - beta) m + beta (p - c)``."""

from __future__ import annotations

from typing import Any

import torch

from gradstat.compressors.base import Compressor, index_dtype
from gradstat.compressors.communicator import Communicator
from gradstat.compressors.exchange import OnlineStep, ReadRow, Stream, Transfer, nbytes
from gradstat.compressors.memory import Memory, ResidualMemory
from gradstat.compressors.shared_index import SharedIndexStream
from gradstat.compressors.sparse_stream import add_with_squares
from gradstat.compressors.topk import top_indices
from gradstat.compressors.work import Ops, Work, passes, scatter, topk


class CLTK(Compressor):
    """ScaleCom's cyclic local top-k: the leader's indices, everyone's values."""

    name = "clt-k"
    collective = "broadcast+allreduce"
    sparse = False

    def __init__(self, k: int, beta: float = 1.0) -> None:
        self.k = k
        self.beta = beta
        self.step_count = 0

    def next_leader(self, n: int) -> int:
        """The learner whose top-k indices everyone uses this step: ``t mod n``."""
        leader = self.step_count % n
        self.step_count += 1
        return leader

    def memory(self) -> Memory:
        return ResidualMemory(beta=self.beta)

    def settings(self) -> dict[str, float]:
        return {"k": self.k, "beta": self.beta}

    def stream(self, scheme: Any, name: str, learners: int, numel: int) -> Stream:
        return CLTKStream(scheme, name, learners, numel)

    def online(self, p: torch.Tensor, name: str, comm: Communicator) -> OnlineStep:
        """Broadcast of the leader's k indices, all-reduce of the k values there."""
        d, k = p.numel(), self.k
        leader = self.next_leader(comm.size)
        indices = torch.empty(k, dtype=index_dtype(d))
        if comm.rank == leader:
            indices.copy_(top_indices(p, k))
        comm.broadcast(indices, root=leader)
        idx = indices.long()
        values = p[idx].clone()
        sent = torch.zeros_like(p)
        sent[idx] = values
        comm.allreduce(values)
        estimate = torch.zeros_like(p)
        estimate[idx] = values / comm.size
        transfers = (Transfer("broadcast", nbytes(indices)), Transfer("allreduce", nbytes(values)))
        return OnlineStep(sent, estimate, transfers, k)

    def work(self, numel: int, memory: Memory) -> Work:
        local = memory.work(numel) + passes(1, numel) + scatter(self.k)
        return Work(local, topk(numel, self.k), scatter(self.k), Ops(), "one")


class CLTKStream(SharedIndexStream):
    """The leader's corrected row is formed first, to pick the indices everyone sends."""

    def choose(self, read_row: ReadRow) -> tuple[torch.Tensor, dict[str, float]]:
        leader = self.compressor.next_leader(self.n)
        g = read_row(leader)
        indices = top_indices(self.leader_row(leader, g), self.compressor.k)
        return indices, {"leader": leader}

    def leader_row(self, leader: int, g: torch.Tensor) -> torch.Tensor:
        """The leader's corrected row. With plain error feedback it is formed in the
        leader's memory row, once, and kept for the leader's turn: a separate ``m + g``
        was one more row (128 MB at 32M values) in every step."""
        if not self.memory.plain_residual:
            return self.memory.peek(leader, g)
        p = self.memory.m.load(leader)
        self.formed = (leader, p, add_with_squares(p, g))
        return p

    def transfers(self) -> tuple[Transfer, ...]:
        index_bytes = self.compressor.k * torch.empty(0, dtype=index_dtype(self.d)).element_size()
        return (Transfer("broadcast", index_bytes), *super().transfers())


def build(ctx: Any) -> Compressor:
    return CLTK(ctx.k, beta=ctx.params["beta"])
