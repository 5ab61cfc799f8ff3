"""The compressor interface: what one step of all learners sends and receives.

Modelled on GRACE (Xu et al. 2021, "GRACE: A Compressed Communication Framework for
Distributed Machine Learning"): compressors, error-feedback memories
(:mod:`gradstat.compressors.memory`) and the collectives they need are separate.

A replay hands a compressor the error-corrected vectors of every learner of one step
``p[n, d]`` (:meth:`Compressor.exchange`) and gets back an :class:`Exchange`: what each
learner contributed (``sent``, for the memory update), the aggregate every learner ends
up with (the estimate of the mean gradient), and the collectives with the exact bytes
each learner puts into them. Compressors that act on each learner alone
(:class:`LocalCompressor`) also offer GRACE's per-learner ``compress`` / ``decompress``
with a :class:`Payload` of the tensors that would go on the wire; byte counts are those
tensors' sizes. Compressors that need every learner at once (CLT-k, gTop-k, PowerSGD,
random-k with a shared seed) implement ``exchange`` directly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch


def index_dtype(numel: int) -> torch.dtype:
    """The index dtype a sparse payload would use: int32 when ``numel < 2**31``."""
    return torch.int32 if numel < 2**31 else torch.int64


def nbytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor occupies on the wire."""
    return tensor.numel() * tensor.element_size()


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack small unsigned codes (each ``< 2**bits``, ``bits`` in 1, 2, 4) into uint8."""
    per = 8 // bits
    pad = (-codes.numel()) % per
    codes = torch.nn.functional.pad(codes.to(torch.int32), (0, pad)).view(-1, per)
    shifts = torch.arange(per, dtype=torch.int32) * bits
    return (codes << shifts).sum(dim=1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``numel`` codes as int32."""
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    codes = (packed.to(torch.int32).unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return codes.view(-1)[:numel]


@dataclass(frozen=True)
class Transfer:
    """One collective call: its kind and the bytes each learner puts in (mean over learners)."""

    collective: str
    nbytes: float


@dataclass
class Payload:
    """What one learner sends: the wire tensors plus context every learner already knows."""

    tensors: tuple[torch.Tensor, ...]
    numel: int
    selected: int
    info: dict[str, float] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(nbytes(t) for t in self.tensors)


@dataclass
class Exchange:
    """The outcome of one step of all learners.

    ``sent[i]`` is learner i's contribution as a dense vector (memory keeps
    ``p_i - sent_i``); ``estimate`` is the aggregate every learner holds afterwards (the
    estimate of the mean gradient); ``selected[i]`` is how many elements learner i sent;
    ``union`` is the number of non-zeros of the aggregate for sparse exchanges (build-up
    of an all-gather), ``None`` for dense ones; ``gathered_bytes`` is what each learner
    holds after an all-gather (every learner's payload), the bytes build-up costs.
    """

    sent: torch.Tensor
    estimate: torch.Tensor
    transfers: tuple[Transfer, ...]
    selected: list[int]
    union: int | None = None
    gathered_bytes: float | None = None
    info: dict[str, float] = field(default_factory=dict)

    @property
    def bytes_per_learner(self) -> float:
        return sum(t.nbytes for t in self.transfers)


class Compressor(ABC):
    """A compressor for one scope of all learners (see the module docstring).

    ``collective`` names the collectives it needs: ``allreduce``, ``allgather``,
    ``broadcast+allreduce`` (CLT-k) or ``reduce+broadcast`` (gTop-k). ``k`` is the target
    number of elements per learner for sparsifiers, ``None`` for dense compressors.
    """

    name: ClassVar[str]
    collective: ClassVar[str]
    k: int | None = None

    @abstractmethod
    def exchange(self, corrected: torch.Tensor) -> Exchange:
        """Compress every learner's corrected vector ``p[n, d]`` and aggregate."""

    def settings(self) -> dict[str, float]:
        """The configuration a user would set to reproduce this compressor."""
        return {} if self.k is None else {"k": self.k}


class LocalCompressor(Compressor):
    """A compressor that encodes each learner alone (GRACE ``compress``/``decompress``).

    The aggregate is the mean of the decompressed payloads; all-gathered sparse payloads
    report the union of their indices (``tensors[0]``) as build-up.
    """

    sparse: ClassVar[bool] = False

    @abstractmethod
    def compress(self, tensor: torch.Tensor, learner: int = 0) -> Payload:
        """Encode one learner's flat vector into the tensors it would send."""

    @abstractmethod
    def decompress(self, payload: Payload) -> torch.Tensor:
        """The dense vector a payload stands for."""

    def aggregate(self, sent: torch.Tensor) -> torch.Tensor:
        """Combine the learners' decompressed vectors: the mean."""
        return sent.mean(dim=0)

    def exchange(self, corrected: torch.Tensor) -> Exchange:
        payloads = [self.compress(row, learner) for learner, row in enumerate(corrected)]
        sent = torch.stack([self.decompress(p) for p in payloads])
        sizes = [p.nbytes for p in payloads]
        mean_bytes = sum(sizes) / len(sizes)
        union = gathered = None
        if self.sparse:
            union = int(torch.unique(torch.cat([p.tensors[0] for p in payloads])).numel())
        if self.collective == "allgather":
            gathered = float(sum(sizes))
        info: dict[str, float] = {}
        for key in payloads[0].info:
            info[key] = sum(p.info[key] for p in payloads) / len(payloads)
        return Exchange(
            sent=sent,
            estimate=self.aggregate(sent),
            transfers=(Transfer(self.collective, mean_bytes),),
            selected=[p.selected for p in payloads],
            union=union,
            gathered_bytes=gathered,
            info=info,
        )


def sparse_payload(
    tensor: torch.Tensor, indices: torch.Tensor, info: dict[str, float] | None = None
) -> Payload:
    """A sparse payload ``(indices, values)`` with int32 (or int64) indices."""
    indices = indices.to(index_dtype(tensor.numel()))
    values = tensor[indices.long()]
    return Payload((indices, values), tensor.numel(), int(indices.numel()), info or {})


def sparse_decompress(payload: Payload) -> torch.Tensor:
    """Scatter a sparse payload's values into a dense zero vector."""
    indices, values = payload.tensors
    out = torch.zeros(payload.numel, dtype=values.dtype)
    out[indices.long()] = values
    return out
