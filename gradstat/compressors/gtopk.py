"""gTop-k (Shi et al. 2019, arXiv 1901.04359): local top-k, then a tree of ``log2 n``
merges, each keeping the top-k of the summed pairs; the result is broadcast down the
tree. A learner's value counts as sent only if it survives every merge on its path to
the root; everything else stays in its residual.

Replay (:class:`GTopKStream`): each learner's local top-k (O(n k) pairs) is kept while
its corrected row is parked in its memory row; after the tree merge a second pass zeroes
what each learner sent (plain error feedback, the only memory it takes). Training
(:meth:`GTopK.online`): a binomial tree of point-to-point sends, each receiver keeping
the top-k of the summed pair, then the root's k pairs go back down the tree with the
index sets of the merged nodes above the receiver, which error feedback needs to know
which of its own pairs survived (the replay's rule).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gradstat.compressors.base import Compressor, index_dtype
from gradstat.compressors.communicator import Communicator
from gradstat.compressors.exchange import OnlineStep, StepOutcome, Stream, Transfer, nbytes
from gradstat.compressors.memory import Memory, row_norm
from gradstat.compressors.topk import top_indices
from gradstat.compressors.work import F, I, Ops, Work, passes, scatter, topk

Node = tuple[torch.Tensor, torch.Tensor]


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

    def tree(self, local: Sequence[Node]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The reduce tree over the learners' local (indices, values) pairs, merged in
        pairs over ceil(log2 n) rounds: the indices of each learner that survive every
        merge it takes part in (what it really sent), and the final global index set."""
        surviving = [indices for indices, _ in local]
        nodes = [(pair, [i]) for i, pair in enumerate(local)]
        while len(nodes) > 1:
            merged = []
            for j in range(0, len(nodes) - 1, 2):
                (left, left_members), (right, right_members) = nodes[j], nodes[j + 1]
                node = self.merge(left, right)
                members = left_members + right_members
                for i in members:
                    surviving[i] = surviving[i][torch.isin(surviving[i], node[0])]
                merged.append((node, members))
            if len(nodes) % 2:
                merged.append(nodes[-1])
            nodes = merged
        return surviving, nodes[0][0][0]

    def pair_bytes(self, d: int) -> int:
        """Bytes of k (index, float32 value) pairs."""
        return self.k * (torch.empty(0, dtype=index_dtype(d)).element_size() + 4)

    def stream(self, scheme: Any, name: str, learners: int, numel: int) -> Stream:
        return GTopKStream(scheme, learners, numel)

    def online(self, p: torch.Tensor, name: str, comm: Communicator) -> OnlineStep:
        return _online(self, p, comm)

    def work(self, numel: int, memory: Memory) -> Work:
        # a merge: unique (sort) of 2k indices, a top-k of up to 2k sums, isin on k
        k = self.k
        merge = Ops(sort=3 * k, topk_in=2 * k, topk_out=k, bytes=2 * k * 3 * (I + F), launches=8)
        local = memory.work(numel) + topk(numel, k) + passes(1, numel) + scatter(k)
        return Work(local, Ops(), merge, passes(1, numel), "tree")


class GTopKStream(Stream):
    """gTop-k's replay step: local top-k now, the tree merge and what each learner sent
    at the end (see the module docstring)."""

    def __init__(self, scheme: Any, learners: int, numel: int) -> None:
        self.compressor, self.memory = scheme.compressor, scheme.memory
        self.n, self.d = learners, numel

    def begin(self, read_row: Any) -> None:
        self.local: list[Node] = []

    def learner(self, i: int, g: torch.Tensor) -> None:
        p, _ = self.memory.compensate(i, g)
        indices = top_indices(p, self.compressor.k)
        self.local.append((indices, p[indices]))
        self.memory.park(i, p)

    def finish(self) -> StepOutcome:
        k = self.compressor.k
        surviving, final = self.compressor.tree(self.local)
        total = torch.zeros(self.d)
        store = self.memory.m
        for i, indices in enumerate(surviving):
            p = store.load(i)
            total[indices] += p[indices]
            p[indices] = 0.0
            store.save(i, p)
            self.memory.norms.append(row_norm(p))
        pair = self.compressor.pair_bytes(self.d)
        return StepOutcome(
            estimate=total / self.n,
            transfers=(Transfer("reduce", pair), Transfer("broadcast", pair)),
            selected=[k] * self.n,
            memory_norm=self.memory.norm(),
            union=int(final.numel()),
        )


def _online(compressor: GTopK, p: torch.Tensor, comm: Communicator) -> OnlineStep:
    """gTop-k's tree: at level l, learner ``r`` with ``r mod 2^(l+1) = 2^l`` sends its
    node (up to k index-value pairs) to ``r - 2^l``, which keeps the top-k of the summed
    pair; then the root's node goes back down with the index sets of the nodes above."""
    rank, world = comm.rank, comm.size
    d, k = p.numel(), compressor.k
    itype = index_dtype(d)
    local = top_indices(p, k).long()
    node = (local, p[local].clone())
    merged: list[tuple[int, torch.Tensor]] = []  # (level, node indices) of own merges
    overhead, parent_level, level = 0, None, 0
    while (1 << level) < world:
        step = 1 << level
        if rank % (2 * step) == step:  # send this node up and stop merging
            _send_node(comm, node, k, itype, rank - step)
            overhead += 8  # the pair count
            parent_level = level
            break
        if rank + step < world:
            node = compressor.merge(node, _recv_node(comm, k, itype, p.dtype, rank + step))
            merged.append((level, node[0]))
        level += 1
    above: list[torch.Tensor] = []
    if parent_level is not None:  # receive the root's node and the sets above
        parent = rank - (1 << parent_level)
        node = _recv_node(comm, k, itype, p.dtype, parent)
        count = comm.recv(torch.zeros(1, dtype=torch.int64), parent)
        above = [_recv_indices(comm, parent) for _ in range(int(count))]
    top = parent_level if parent_level is not None else level
    for child_level in reversed(range(top)):
        child = rank + (1 << child_level)
        if child >= world:
            continue
        sets = [indices for lv, indices in merged if lv >= child_level] + above
        _send_node(comm, node, k, itype, child)
        comm.send(torch.tensor([len(sets)], dtype=torch.int64), child)
        overhead += 16 + sum(_send_indices(comm, indices, child) for indices in sets)
    survivors = local
    for indices in [indices for _, indices in merged] + above:
        survivors = survivors[torch.isin(survivors, indices)]
    sent = torch.zeros_like(p)
    sent[survivors] = p[survivors]
    estimate = torch.zeros_like(p)
    estimate[node[0]] = node[1] / world
    pair = compressor.pair_bytes(d)
    transfers = (Transfer("reduce", pair), Transfer("broadcast", pair))
    return OnlineStep(sent, estimate, transfers, k, overhead)


def _send_node(comm: Communicator, node: Node, k: int, itype: torch.dtype, dst: int) -> None:
    """Send up to k (index, value) pairs, padded to k, after their count."""
    indices, values = node
    count = torch.tensor([indices.numel()], dtype=torch.int64)
    buf_i = torch.zeros(k, dtype=itype)
    buf_v = torch.zeros(k, dtype=values.dtype)
    buf_i[: indices.numel()] = indices.to(itype)
    buf_v[: values.numel()] = values
    for tensor in (count, buf_i, buf_v):
        comm.send(tensor, dst)


def _recv_node(
    comm: Communicator, k: int, itype: torch.dtype, dtype: torch.dtype, src: int
) -> Node:
    count = torch.zeros(1, dtype=torch.int64)
    buf_i = torch.zeros(k, dtype=itype)
    buf_v = torch.zeros(k, dtype=dtype)
    for tensor in (count, buf_i, buf_v):
        comm.recv(tensor, src)
    n = int(count)
    return buf_i[:n].long(), buf_v[:n]


def _send_indices(comm: Communicator, indices: torch.Tensor, dst: int) -> int:
    size = torch.tensor([indices.numel()], dtype=torch.int64)
    payload = indices.to(torch.int32)
    comm.send(size, dst)
    comm.send(payload, dst)
    return nbytes(size) + nbytes(payload)


def _recv_indices(comm: Communicator, src: int) -> torch.Tensor:
    size = comm.recv(torch.zeros(1, dtype=torch.int64), src)
    return comm.recv(torch.zeros(int(size), dtype=torch.int32), src).long()


def build(ctx: Any) -> Compressor:
    return GTopK(ctx.k)
