"""Top-k (Aji and Heafield 2017; Stich et al. 2018): each learner sends the k largest
magnitudes of its corrected vector as ``(int32 index, value)`` pairs; all-gathered, so
the aggregate holds the union of the learners' sets (build-up, docs/methods.md 3). The
rate is the density ``k/d`` (``k = k_for(ratio, d)`` of each message).

:class:`Sparsifier` is what every ``(indices, values)`` sparsifier shares (top-k and the
threshold sparsifiers): what a learner sent and the aggregate are kept as sparse rows
(:class:`~gradstat.compressors.exchange.SparseRow`), never as dense vectors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gradstat.compressors.base import Compressor, index_dtype
from gradstat.compressors.exchange import SparseRow, Tensors, sparse_mean
from gradstat.compressors.memory import Memory, ResidualMemory
from gradstat.compressors.work import Ops, Work, passes, scatter, topk
from gradstat.stats.topk_sets import topk_indices


def sparse_payload(tensor: torch.Tensor, indices: torch.Tensor) -> Tensors:
    """``(indices, values)`` with int32 (or int64 past 2^31 elements) indices."""
    indices = indices.to(index_dtype(tensor.numel()))
    return indices, tensor[indices.long()]


class Sparsifier(Compressor):
    """A sparsifier whose payload is ``(indices, values)`` with ``values`` the vector's
    own there; its context starts with the vector's length (:meth:`numel_of`)."""

    collective = "allgather"
    sparse = True

    def numel_of(self, ctx: Any) -> int:
        return ctx

    def decompress(self, tensors: Tensors, ctx: Any) -> torch.Tensor:
        return self.own(tensors, ctx).dense()

    def own(self, tensors: Tensors, ctx: Any) -> SparseRow:
        return SparseRow(self.numel_of(ctx), tensors[0], tensors[1])

    def combine(self, payloads: Sequence[Tensors], ctx: Any, n: int) -> SparseRow:
        """The mean of the payloads at the indices any learner sent (bit for bit the
        dense sum learner by learner, divided by n)."""
        return sparse_mean([self.own(q, ctx) for q in payloads], n)[0]

    def memory(self) -> Memory:
        return ResidualMemory()


class TopK(Sparsifier):
    """Exact top-k of each learner's corrected vector, all-gathered."""

    name = "topk"

    def __init__(self, k: int) -> None:
        self.k = k

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Tensors, Any]:
        flat = tensor.reshape(-1)
        return sparse_payload(flat, topk_indices(flat, self.k)), flat.numel()

    def work(self, numel: int, memory: Memory) -> Work:
        d, k = numel, self.k
        local = memory.work(d) + topk(d, k) + passes(1, d)  # a dense zero vector
        return Work(local, Ops(), scatter(k), "all")


def build(ctx: Any) -> Compressor:
    return TopK(ctx.k)
