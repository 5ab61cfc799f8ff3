"""One learner's side of a compressor's exchange, with real ``torch.distributed`` calls.

The replay (:meth:`gradstat.compressors.legacy.Compressor.exchange`) compresses every
learner of a step at once; in training each learner holds only its own corrected vector
``p`` and talks to the others through collectives. :func:`online_exchange` runs the same
compressor objects the replay builds (their ``compress`` / ``decompress`` / ``aggregate``,
random-k's shared draw, CLT-k's leader rotation and top-k, PowerSGD's matrices and warm
start) with the collectives the replay's cost model assumes:

* all-gather of each payload tensor for all-gathered compressors (sparse ``(index,
  value)`` pairs, sign bits and scale, QSGD levels and norms, TernGrad codes), then every
  learner decodes all payloads and aggregates as the replay does. Payloads of varying
  length (threshold sparsifiers) are padded to the longest: the learners first all-gather
  their lengths (8 bytes each), and the padding is counted apart (``padding_bytes``);
* all-reduce (sum) of the encoded tensor for casts and the dense baseline, then decode
  and divide by n;
* random-k: all-reduce of the k values at the shared indices;
* CLT-k: broadcast of the leader's k indices, all-reduce of the k values there;
* PowerSGD: all-reduce of ``[uncompressed values, P]``, orthogonalisation, all-reduce of
  ``Q``;
* gTop-k: a binomial tree of point-to-point sends, each receiver keeping the top-k of the
  summed pair (the replay's ``_merge``), then the root's k pairs go back down the tree
  (``broadcast``), each with the index sets of the merged nodes above the receiver, which
  error feedback needs to know which of its own pairs survived (the replay's rule).

``Transfer.nbytes`` is what this learner put into each collective (payload tensors),
which is what the replay reports per learner; ``overhead_bytes`` counts what goes beyond:
all-gather padding and lengths, gTop-k's node counts and survival sets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from gradstat.compressors.estimated import EstimatedSparsifier
from gradstat.compressors.legacy import (
    Compressor,
    LocalCompressor,
    Payload,
    Transfer,
    index_dtype,
    nbytes,
)
from gradstat.compressors.powersgd import PowerSGD
from gradstat.compressors.sparse import CLTK, GTopK, RandomK, top_indices
from gradstat.stats.thresholds import estimate_threshold


@dataclass
class OnlineStep:
    """One learner's outcome of one step: what it contributed and what everyone holds."""

    sent: torch.Tensor
    estimate: torch.Tensor
    transfers: tuple[Transfer, ...]
    selected: int
    overhead_bytes: int = 0

    @property
    def payload_bytes(self) -> float:
        return sum(t.nbytes for t in self.transfers)


def online_exchange(
    compressor: Compressor, p: torch.Tensor, group: dist.ProcessGroup | None = None
) -> OnlineStep:
    """Compress this learner's corrected vector ``p`` (1-D) and aggregate with the others."""
    if isinstance(compressor, RandomK):
        return _randomk(compressor, p, group)
    if isinstance(compressor, CLTK):
        return _cltk(compressor, p, group)
    if isinstance(compressor, GTopK):
        return _gtopk(compressor, p, group)
    if isinstance(compressor, PowerSGD):
        return _powersgd(compressor, p, group)
    if isinstance(compressor, LocalCompressor):
        return _local(compressor, p, group)
    raise ValueError(f"{compressor.name} has no online form")


def _world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    """The global rank of ``rank`` in ``group`` (point-to-point calls take global ranks)."""
    return rank if group is None else dist.get_global_rank(group, rank)


def _all_gather_padded(
    tensor: torch.Tensor, group: dist.ProcessGroup | None
) -> tuple[list[torch.Tensor], int]:
    """All-gather 1-D tensors of possibly different lengths; returns them and the bytes
    this learner added beyond its tensor (its length and the padding)."""
    _, world = _world(group)
    length = torch.tensor([tensor.numel()], dtype=torch.int64)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(n) for n in lengths]
    longest = max(sizes)
    padded = torch.zeros(longest, dtype=tensor.dtype)
    padded[: tensor.numel()] = tensor
    gathered = [torch.empty(longest, dtype=tensor.dtype) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    padding = (longest - tensor.numel()) * tensor.element_size() + nbytes(length)
    return [g[:size] for g, size in zip(gathered, sizes, strict=True)], padding


def _calibrate_hard_threshold(
    compressor: EstimatedSparsifier, p: torch.Tensor, group: dist.ProcessGroup | None
) -> None:
    """The replay calibrates a fixed threshold on learner 0's first step: do the same and
    broadcast it, so every learner uses learner 0's value."""
    rank, _ = _world(group)
    value = torch.zeros(1, dtype=torch.float64)
    if rank == 0:
        value[0] = estimate_threshold(p, compressor.ratio, "topk").threshold
    dist.broadcast(value, src=_global(group, 0), group=group)
    compressor.threshold = float(value[0])


def _local(compressor: LocalCompressor, p: torch.Tensor, group) -> OnlineStep:
    rank, world = _world(group)
    if (
        isinstance(compressor, EstimatedSparsifier)
        and compressor.estimator == "hard"
        and compressor.threshold is None
    ):
        _calibrate_hard_threshold(compressor, p, group)
    payload = compressor.compress(p, learner=rank)
    sent = compressor.decompress(payload).clone()
    if compressor.collective == "allreduce":
        summed = tuple(t.clone() for t in payload.tensors)
        for tensor in summed:
            dist.all_reduce(tensor, group=group)
        total = compressor.decompress(Payload(summed, payload.numel, payload.selected))
        transfer = Transfer("allreduce", payload.nbytes)
        return OnlineStep(sent, total / world, (transfer,), payload.selected)
    columns, padding = [], 0
    for tensor in payload.tensors:
        gathered, pad = _all_gather_padded(tensor, group)
        columns.append(gathered)
        padding += pad
    payloads = [
        Payload(tuple(column[i] for column in columns), payload.numel, 0) for i in range(world)
    ]
    decoded = torch.stack([compressor.decompress(q) for q in payloads])
    decoded[rank] = sent  # bit-identical to what this learner decoded itself
    estimate = compressor.aggregate(decoded)
    transfer = Transfer("allgather", payload.nbytes)
    return OnlineStep(sent, estimate, (transfer,), payload.selected, padding)


def _randomk(compressor: RandomK, p: torch.Tensor, group) -> OnlineStep:
    _, world = _world(group)
    indices = compressor.draw(p.numel())
    values = p[indices].clone()
    sent = torch.zeros_like(p)
    sent[indices] = values
    dist.all_reduce(values, group=group)
    estimate = torch.zeros_like(p)
    estimate[indices] = values / world
    return OnlineStep(sent, estimate, (Transfer("allreduce", nbytes(values)),), compressor.k)


def _cltk(compressor: CLTK, p: torch.Tensor, group) -> OnlineStep:
    rank, world = _world(group)
    d, k = p.numel(), compressor.k
    leader = compressor.next_leader(world)
    indices = torch.empty(k, dtype=index_dtype(d))
    if rank == leader:
        indices.copy_(top_indices(p, k))
    dist.broadcast(indices, src=_global(group, leader), group=group)
    idx = indices.long()
    values = p[idx].clone()
    sent = torch.zeros_like(p)
    sent[idx] = values
    dist.all_reduce(values, group=group)
    estimate = torch.zeros_like(p)
    estimate[idx] = values / world
    transfers = (Transfer("broadcast", nbytes(indices)), Transfer("allreduce", nbytes(values)))
    return OnlineStep(sent, estimate, transfers, k)


def _powersgd(compressor: PowerSGD, p: torch.Tensor, group) -> OnlineStep:
    """PowerSGD's two all-reduces, with the replay's matrices, warm start and residual
    rule (uncompressed parameters are sent as they are)."""
    _, world = _world(group)
    d, r = p.numel(), compressor.rank
    if d != compressor.numel:
        raise ValueError(f"powersgd was planned for {compressor.numel} elements, got {d}")
    if compressor.q is None:
        compressor.q = compressor._initial_q(p.dtype)
    dense = [p[offset : offset + numel] for offset, numel in compressor.dense]
    matrices = [p[o : o + a * b].view(a, b) for o, a, b in compressor.matrices]
    first = torch.cat(
        dense + [(m @ q).reshape(-1) for m, q in zip(matrices, compressor.q, strict=True)]
    )
    first_bytes = nbytes(first)
    dist.all_reduce(first, group=group)
    first /= world
    estimate = torch.zeros_like(p)
    position = 0
    for (offset, numel), _ in zip(compressor.dense, dense, strict=True):
        estimate[offset : offset + numel] = first[position : position + numel]
        position += numel
    ps = []
    for _, a, _ in compressor.matrices:
        ps.append(torch.linalg.qr(first[position : position + a * r].view(a, r)).Q)
        position += a * r
    transfers = [Transfer("allreduce", first_bytes)]
    if matrices:
        second = torch.cat([(m.T @ pm).reshape(-1) for m, pm in zip(matrices, ps, strict=True)])
        transfers.append(Transfer("allreduce", nbytes(second)))
        dist.all_reduce(second, group=group)
        second /= world
        position = 0
        for j, ((offset, a, b), pm) in enumerate(zip(compressor.matrices, ps, strict=True)):
            q = second[position : position + b * r].view(b, r).clone()
            position += b * r
            compressor.q[j] = q
            estimate[offset : offset + a * b] = (pm @ q.T).reshape(-1)
    sent = estimate.clone()
    for offset, numel in compressor.dense:
        sent[offset : offset + numel] = p[offset : offset + numel]
    return OnlineStep(sent, estimate, tuple(transfers), d)


def _gtopk(compressor: GTopK, p: torch.Tensor, group) -> OnlineStep:
    """gTop-k's tree: at level l, learner ``r`` with ``r mod 2^(l+1) = 2^l`` sends its
    node (up to k index-value pairs) to ``r - 2^l``, which keeps the top-k of the summed
    pair; then the root's node goes back down the same tree with the index sets of the
    nodes above each receiver, so every learner keeps exactly the pairs that survived
    every merge on its path (the replay's rule) and the rest in its residual."""
    rank, world = _world(group)
    d, k = p.numel(), compressor.k
    itype = index_dtype(d)
    local = top_indices(p, k).long()
    node = (local, p[local].clone())
    merged: list[tuple[int, torch.Tensor]] = []  # (level, node indices) of own merges
    overhead = 0
    parent_level = None
    level = 0
    while (1 << level) < world:
        step = 1 << level
        if rank % (2 * step) == step:  # send this node up and stop merging
            _send_node(node, k, itype, _global(group, rank - step), group)
            overhead += 8  # the pair count
            parent_level = level
            break
        if rank + step < world:
            other = _recv_node(k, itype, p.dtype, _global(group, rank + step), group)
            node = compressor._merge(node, other)
            merged.append((level, node[0]))
        level += 1
    above: list[torch.Tensor] = []
    if parent_level is not None:  # receive the root's node and the sets above
        parent = _global(group, rank - (1 << parent_level))
        node = _recv_node(k, itype, p.dtype, parent, group)
        count = torch.zeros(1, dtype=torch.int64)
        dist.recv(count, parent, group=group)
        for _ in range(int(count)):
            above.append(_recv_indices(parent, group))
    top = parent_level if parent_level is not None else level
    for child_level in reversed(range(top)):
        child = rank + (1 << child_level)
        if child >= world:
            continue
        sets = [indices for lv, indices in merged if lv >= child_level] + above
        dst = _global(group, child)
        _send_node(node, k, itype, dst, group)
        overhead += 8
        dist.send(torch.tensor([len(sets)], dtype=torch.int64), dst, group=group)
        overhead += 8
        for indices in sets:
            overhead += _send_indices(indices, dst, group)
    survivors = local
    for indices in [indices for _, indices in merged] + above:
        survivors = survivors[torch.isin(survivors, indices)]
    sent = torch.zeros_like(p)
    sent[survivors] = p[survivors]
    estimate = torch.zeros_like(p)
    estimate[node[0]] = node[1] / world
    pair = k * (torch.empty(0, dtype=itype).element_size() + p.element_size())
    transfers = (Transfer("reduce", pair), Transfer("broadcast", pair))
    return OnlineStep(sent, estimate, transfers, k, overhead)


def _send_node(node, k: int, itype, dst: int, group) -> None:
    """Send up to k (index, value) pairs, padded to k, after their count."""
    indices, values = node
    count = torch.tensor([indices.numel()], dtype=torch.int64)
    buf_i = torch.zeros(k, dtype=itype)
    buf_v = torch.zeros(k, dtype=values.dtype)
    buf_i[: indices.numel()] = indices.to(itype)
    buf_v[: values.numel()] = values
    for tensor in (count, buf_i, buf_v):
        dist.send(tensor, dst, group=group)


def _recv_node(k: int, itype, dtype, src: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    count = torch.zeros(1, dtype=torch.int64)
    buf_i = torch.zeros(k, dtype=itype)
    buf_v = torch.zeros(k, dtype=dtype)
    for tensor in (count, buf_i, buf_v):
        dist.recv(tensor, src, group=group)
    n = int(count)
    return buf_i[:n].long(), buf_v[:n]


def _send_indices(indices: torch.Tensor, dst: int, group) -> int:
    size = torch.tensor([indices.numel()], dtype=torch.int64)
    payload = indices.to(torch.int32)
    dist.send(size, dst, group=group)
    dist.send(payload, dst, group=group)
    return nbytes(size) + nbytes(payload)


def _recv_indices(src: int, group) -> torch.Tensor:
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    indices = torch.zeros(int(size), dtype=torch.int32)
    dist.recv(indices, src, group=group)
    return indices.long()
