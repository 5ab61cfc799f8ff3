"""gTop-k (Shi et al. 2019, arXiv 1901.04359): local top-k, then a tree of ``log2 n``
merges, each keeping the top-k of the summed pairs; the result goes back down the tree.
A learner's value counts as sent only if it survives every merge on its path to the
root; everything else stays in its residual.

One exchange, rounds of point-to-point messages (a binomial tree): at level l, learner
``r`` with ``r mod 2^(l+1) = 2^l`` sends its node (up to k index-value pairs, padded to
k after their count) to ``r - 2^l``, which keeps the top-k of the summed pair; then, from
the top level down, each parent sends its children the root's node and the indices that
survived every merge above them (the intersection of its own merges from that level up
and what survived above it), from which a learner finds which of its pairs were sent.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gradstat.compressors.base import Compressor, Exchange, index_dtype
from gradstat.compressors.exchange import Call, Round, Sent, SparseRow, Tensors, Transfer
from gradstat.compressors.memory import Memory, ResidualMemory
from gradstat.compressors.work import F, I, Ops, Work, passes, scatter, topk
from gradstat.stats.topk_sets import topk_indices

Node = tuple[torch.Tensor, torch.Tensor]


def _pack(indices: torch.Tensor, values: torch.Tensor | None, k: int, itype: torch.dtype) -> list:
    """Up to k indices (and values), padded to k after their count."""
    count = torch.tensor([indices.numel()], dtype=torch.int64)
    packed = [count, torch.zeros(k, dtype=itype)]
    packed[1][: indices.numel()] = indices.to(itype)
    if values is not None:
        packed.append(torch.zeros(k, dtype=values.dtype))
        packed[2][: values.numel()] = values
    return packed


def _unpack(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    n = int(tensors[0][0])
    return [tensors[1][:n].long(), *(t[:n] for t in tensors[2:])]


def _intersection(sets: list[torch.Tensor]) -> torch.Tensor:
    kept = sets[0]
    for other in sets[1:]:
        kept = kept[torch.isin(kept, other)]
    return kept


class GTopK(Compressor):
    """Global top-k by a tree of pairwise merges (reduce), then a broadcast of the result."""

    name = "gtopk"
    collective = "reduce+broadcast"
    sparse = False

    def __init__(self, k: int) -> None:
        self.k = k

    def merge(self, a: Node, b: Node) -> Node:
        """Sum two sparse vectors and keep the top-k of the sum."""
        indices, inverse = torch.unique(torch.cat([a[0], b[0]]), return_inverse=True)
        summed = torch.zeros(indices.numel(), dtype=a[1].dtype)
        summed.index_add_(0, inverse, torch.cat([a[1], b[1]]))
        if indices.numel() > self.k:
            keep = torch.topk(summed.abs(), self.k, sorted=False).indices
            indices, summed = indices[keep], summed[keep]
        return indices, summed

    def decompress(self, tensors: Tensors, ctx: Any) -> torch.Tensor:
        """The root's node (its pairs) as a dense vector; the context is the length."""
        indices, values = tensors
        return SparseRow(ctx, indices.long(), values).dense()

    def memory(self) -> Memory:
        return ResidualMemory()

    def exchange(self, p: torch.Tensor, call: Call) -> Exchange:
        flat = p.reshape(-1)
        d, k, rank, world = flat.numel(), self.k, call.learner, call.learners
        itype = index_dtype(d)
        local = topk_indices(flat, k).long()
        node: Node = (local, flat[local])
        node_shapes = [((1,), torch.int64), ((k,), itype), ((k,), flat.dtype)]
        levels = math.ceil(math.log2(world)) if world > 1 else 0
        merged: list[tuple[int, torch.Tensor]] = []  # (level, indices) of own merges
        up = None  # the level this learner sends its node up at (None: the root)
        for level in range(levels):
            step = 1 << level
            sends, receives = {}, {}
            if up is None and rank % (2 * step) == step:
                sends, up = {rank - step: _pack(*node, k, itype)}, level
            elif up is None and rank % (2 * step) == 0 and rank + step < world:
                receives = {rank + step: node_shapes}
            got = yield Round(sends, receives)
            if receives:
                node = self.merge(node, tuple(_unpack(got[rank + step])))
                merged.append((level, node[0]))
        above: torch.Tensor | None = None  # what survived every merge above this learner
        overhead = 0
        for level in reversed(range(levels)):
            step = 1 << level
            sends, receives = {}, {}
            if up == level:
                receives = {rank - step: [*node_shapes, ((1,), torch.int64), ((k,), itype)]}
            elif (up is None or level < up) and rank % (2 * step) == 0 and rank + step < world:
                sets = [s for lv, s in merged if lv >= level] + (
                    [above] if above is not None else []
                )
                sends = {
                    rank + step: _pack(*node, k, itype) + _pack(_intersection(sets), None, k, itype)
                }
                overhead += 16 + 4 * k
            got = yield Round(sends, receives)
            if receives:
                parts = got[rank - step]
                node = tuple(_unpack(parts[:3]))
                above = _unpack(parts[3:])[0]
        sets = [s for _, s in merged] + ([above] if above is not None else [])
        survivors = _intersection([local, *sets])
        sent = SparseRow(d, survivors, flat[survivors])
        estimate = SparseRow(d, node[0], node[1] / world)
        pair = k * (torch.empty(0, dtype=itype).element_size() + F)  # k (index, value) pairs
        transfers = (Transfer("reduce", pair), Transfer("broadcast", pair))
        payload = (survivors, sent.values)  # what a GRACE memory decodes as sent
        return Sent(sent, estimate, transfers, k, None, {}, payload, d, overhead)

    def work(self, numel: int, memory: Memory) -> Work:
        # a merge: unique (sort) of 2k indices, a top-k of up to 2k sums, isin on k
        k = self.k
        merge = Ops(sort=3 * k, topk_in=2 * k, topk_out=k, bytes=2 * k * 3 * (I + F), launches=8)
        local = memory.work(numel) + topk(numel, k) + passes(1, numel) + scatter(k)
        return Work(local, Ops(), merge, "tree")


def build(ctx: Any) -> Compressor:
    return GTopK(ctx.k)
