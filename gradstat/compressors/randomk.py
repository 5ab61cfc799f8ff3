"""Random-k with a shared seed (Stich et al. 2018): every learner draws the same k
indices from the seed they share, so only the k values travel, by a dense all-reduce
(GRACE's ``RandomKCompressor``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from gradstat.compressors.base import Compressor
from gradstat.compressors.communicator import Communicator
from gradstat.compressors.exchange import OnlineStep, ReadRow, Stream, Tensors
from gradstat.compressors.online import local_online
from gradstat.compressors.shared_index import SharedIndexStream
from gradstat.compressors.work import Ops, Work, passes, scatter


class RandomK(Compressor):
    """Random-k with a seed shared by all learners: k values all-reduced, no indices."""

    name = "randomk"
    collective = "allreduce"
    sparse = False

    def __init__(self, k: int, seed: int = 0) -> None:
        self.k = k
        self.generator = torch.Generator().manual_seed(seed)

    def draw(self, d: int) -> torch.Tensor:
        """This step's k indices: the same on every learner (shared seed)."""
        return torch.randperm(d, generator=self.generator)[: self.k]

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Tensors, Any]:
        """The values at this step's indices; the context is the indices and the size."""
        indices = self.draw(tensor.numel())
        return (tensor[indices].clone(),), (indices, tensor.numel())

    def decompress(self, tensors: Tensors, ctx: Any) -> torch.Tensor:
        indices, numel = ctx
        out = torch.zeros(numel, dtype=tensors[0].dtype)
        out[indices] = tensors[0]
        return out

    def stream(self, scheme: Any, name: str, learners: int, numel: int) -> Stream:
        return RandomKStream(scheme, name, learners, numel)

    def online(self, p: torch.Tensor, name: str, comm: Communicator) -> OnlineStep:
        return replace(local_online(self, p, name, comm), selected=self.k)

    def work(self, numel: int, memory: Any) -> Work:
        local = memory.work(numel) + passes(1, numel) + scatter(self.k)
        return Work(local, Ops(randperm=numel, launches=1), scatter(self.k), Ops(), "one")


class RandomKStream(SharedIndexStream):
    """The step's indices drawn once for every learner (they share the seed)."""

    def choose(self, read_row: ReadRow) -> tuple[torch.Tensor, dict[str, float]]:
        return self.compressor.draw(self.d), {}


def build(ctx: Any) -> Compressor:
    return RandomK(ctx.k, seed=ctx.seed)
