"""Sparsifiers that need no threshold estimator: top-k, random-k, CLT-k and gTop-k.

For sparsifiers the rate is the density ``k/d`` (``k = k_for(ratio, d)``).

* Top-k (Aji and Heafield 2017; Stich et al. 2018): each learner sends the k largest
  magnitudes of its corrected vector as ``(int32 index, value)`` pairs; all-gather, so
  the aggregate holds the union of the learners' sets (build-up, docs/methods.md 3).
* Random-k with a shared seed (Stich et al. 2018): every learner draws the same k
  indices, so only the k values travel, by a dense all-reduce.
* CLT-k (ScaleCom, Chen et al. 2021, arXiv 2104.11125, docs/methods.md 4): the leader
  ``t mod n`` broadcasts its top-k indices; every learner all-reduces its values at
  those indices. Exactly k non-zeros whatever n.
* gTop-k (Shi et al. 2019, arXiv 1901.04359): local top-k, then a tree of ``log2 n``
  merges, each keeping the top-k of the summed pairs; the result is broadcast down the
  tree. A learner's value counts as sent only if it survives every merge on its path to
  the root; everything else stays in its residual.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gradstat.compressors.legacy import (
    Compressor,
    Exchange,
    LocalCompressor,
    Payload,
    Transfer,
    index_dtype,
    sparse_decompress,
    sparse_payload,
)
from gradstat.stats.topk_sets import topk_indices


def top_indices(tensor: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest magnitudes, unsorted: the set ``torch.topk`` picks
    (ties broken either way), from a sampled threshold's candidates on long vectors
    (:func:`~gradstat.stats.topk_sets.topk_indices`; 6 ms for 8M values against 60)."""
    return topk_indices(tensor.reshape(-1), k)


class TopK(LocalCompressor):
    """Exact top-k of each learner's corrected vector, all-gathered."""

    name = "topk"
    collective = "allgather"
    sparse = True

    def __init__(self, k: int) -> None:
        self.k = k

    def compress(self, tensor: torch.Tensor, learner: int = 0) -> Payload:
        return sparse_payload(tensor, top_indices(tensor, self.k))

    def decompress(self, payload: Payload) -> torch.Tensor:
        return sparse_decompress(payload)


class RandomK(Compressor):
    """Random-k with a seed shared by all learners: k values all-reduced, no indices."""

    name = "randomk"
    collective = "allreduce"

    def __init__(self, k: int, seed: int = 0) -> None:
        self.k = k
        self.generator = torch.Generator().manual_seed(seed)

    def draw(self, d: int) -> torch.Tensor:
        """This step's k indices: the same on every learner (shared seed)."""
        return torch.randperm(d, generator=self.generator)[: self.k]

    def exchange(self, corrected: torch.Tensor) -> Exchange:
        n, d = corrected.shape
        indices = self.draw(d)
        values = corrected[:, indices]
        sent = torch.zeros_like(corrected)
        sent[:, indices] = values
        estimate = torch.zeros(d, dtype=corrected.dtype)
        estimate[indices] = values.mean(dim=0)
        return Exchange(
            sent=sent,
            estimate=estimate,
            transfers=(Transfer("allreduce", self.k * values.element_size()),),
            selected=[self.k] * n,
            union=self.k,
        )


class CLTK(Compressor):
    """ScaleCom's cyclic local top-k: the leader's indices, everyone's values."""

    name = "clt-k"
    collective = "broadcast+allreduce"

    def __init__(self, k: int, beta: float = 1.0) -> None:
        self.k = k
        self.beta = beta
        self.step_count = 0

    def next_leader(self, n: int) -> int:
        """The learner whose top-k indices everyone uses this step: ``t mod n``."""
        leader = self.step_count % n
        self.step_count += 1
        return leader

    def exchange(self, corrected: torch.Tensor) -> Exchange:
        n, d = corrected.shape
        leader = self.next_leader(n)
        indices = top_indices(corrected[leader], self.k)
        values = corrected[:, indices]
        sent = torch.zeros_like(corrected)
        sent[:, indices] = values
        estimate = torch.zeros(d, dtype=corrected.dtype)
        estimate[indices] = values.mean(dim=0)
        index_bytes = self.k * torch.empty(0, dtype=index_dtype(d)).element_size()
        return Exchange(
            sent=sent,
            estimate=estimate,
            transfers=(
                Transfer("broadcast", index_bytes),
                Transfer("allreduce", self.k * values.element_size()),
            ),
            selected=[self.k] * n,
            union=self.k,
            info={"leader": leader},
        )

    def settings(self) -> dict[str, float]:
        return {"k": self.k, "beta": self.beta}


class GTopK(Compressor):
    """Global top-k by a tree of pairwise merges (reduce), then a broadcast of the result."""

    name = "gtopk"
    collective = "reduce+broadcast"

    def __init__(self, k: int) -> None:
        self.k = k

    def _merge(
        self, a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum two sparse vectors and keep the top-k of the sum."""
        indices, inverse = torch.unique(torch.cat([a[0], b[0]]), return_inverse=True)
        summed = torch.zeros(indices.numel(), dtype=a[1].dtype)
        summed.index_add_(0, inverse, torch.cat([a[1], b[1]]))
        if indices.numel() > self.k:
            keep = torch.topk(summed.abs(), self.k, sorted=False).indices
            indices, summed = indices[keep], summed[keep]
        return indices, summed

    def tree(
        self, local: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The reduce tree over the learners' local (indices, values) pairs, merged in
        pairs over ceil(log2 n) rounds: the indices of each learner that survive every
        merge it takes part in (what it really sent), and the final global index set."""
        surviving = [indices for indices, _ in local]
        nodes = [(pair, [i]) for i, pair in enumerate(local)]
        while len(nodes) > 1:
            merged = []
            for j in range(0, len(nodes) - 1, 2):
                (left, left_members), (right, right_members) = nodes[j], nodes[j + 1]
                node = self._merge(left, right)
                members = left_members + right_members
                for i in members:
                    surviving[i] = surviving[i][torch.isin(surviving[i], node[0])]
                merged.append((node, members))
            if len(nodes) % 2:
                merged.append(nodes[-1])
            nodes = merged
        return surviving, nodes[0][0][0]

    def exchange(self, corrected: torch.Tensor) -> Exchange:
        n, d = corrected.shape
        local = [top_indices(row, self.k) for row in corrected]
        surviving, final = self.tree(
            [(idx, row[idx]) for idx, row in zip(local, corrected, strict=True)]
        )
        sent = torch.zeros_like(corrected)
        for i, idx in enumerate(surviving):
            sent[i, idx] = corrected[i, idx]
        pair_bytes = self.k * (
            torch.empty(0, dtype=index_dtype(d)).element_size() + corrected.element_size()
        )
        return Exchange(
            sent=sent,
            estimate=sent.mean(dim=0),
            transfers=(Transfer("reduce", pair_bytes), Transfer("broadcast", pair_bytes)),
            selected=[self.k] * n,
            union=int(final.numel()),
        )
