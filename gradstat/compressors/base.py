"""The compressor protocol: one class per compressor, in GRACE's shape.

Modelled on GRACE (Xu et al. 2021, "GRACE: A Compressed Communication Framework for
Distributed Machine Learning"): a compressor encodes one learner's tensor of one message
(:meth:`Compressor.compress`), decodes a payload (:meth:`Compressor.decompress`) and
combines the decoded payloads of every learner (:meth:`Compressor.aggregate`); its
error-feedback memory (:mod:`gradstat.compressors.memory`) and the collective that moves
the payloads are separate, and a plain GRACE class runs everywhere a built-in does.

The exchange is written once, :meth:`Compressor.exchange`: a generator that yields the
collectives it needs (:mod:`gradstat.compressors.exchange`) and returns what this
learner sent and the aggregate; a method that needs every learner (CLT-k's leader,
gTop-k's tree, PowerSGD's two all-reduces, random-k's shared draw) overrides it. Each
learner has its own compressor object for each message, in the replay as in training.
docs/compressors.md describes the protocol, its defaults and what each driver does.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from typing import Any

import torch

from gradstat.compressors.exchange import (
    AllGather,
    AllReduce,
    Call,
    Sent,
    Shared,
    SparseRow,
    Tensors,
    Transfer,
    nbytes,
)
from gradstat.compressors.memory import Memory, NoMemory
from gradstat.compressors.work import Work, generic_work

Exchange = Generator[Any, Any, Sent]


def index_dtype(numel: int) -> torch.dtype:
    """The index dtype a sparse payload would use: int32 when ``numel < 2**31``."""
    return torch.int32 if numel < 2**31 else torch.int64


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


def payload_count(tensors: Tensors) -> tuple[int, torch.Tensor | None]:
    """Values a payload carries and the indices it names, counted from the payload: the
    length of its longest tensor (values or codes, one per element they stand for); its
    indices are an integer tensor as long as a floating-point one (a sparse payload's
    ``(values, indices)`` in either order), else None."""
    longest = max((t.numel() for t in tensors), default=0)
    floats = {t.numel() for t in tensors if t.is_floating_point()}
    for t in tensors:
        if not t.is_floating_point() and t.numel() in floats and t.numel() == longest:
            return longest, t.reshape(-1)
    return longest, None


class Compressor:
    """A gradient compressor, one learner's view of one message (see the module docstring).

    Class attributes a subclass may set: ``name`` (its label); ``collective``:
    ``"allgather"`` (every payload decoded, then :meth:`aggregate`) or ``"allreduce"``
    (the payloads summed element-wise, decoded once) for the default exchange, a name of
    its own for an exchange of its own (``"broadcast+allreduce"``); ``average`` (the
    aggregate divided by the learners); ``sparse`` (how the values sent are counted:
    ``True`` from ``tensors[0]``, the indices; ``False`` every element; ``None`` from the
    payload, :func:`payload_count`); ``k`` (a sparsifier's target count, else ``None``);
    ``draws`` (the default exchange reseeds its ``generator`` from each call's seed).
    """

    name: str = ""
    collective: str = "allgather"
    average: bool = True
    sparse: bool | None = None
    k: int | None = None
    draws: bool = False
    #: A collective gradstat emulates (a number format on the wire): priced by its work
    #: model, not by timing the emulation.
    emulated: bool = False

    # --- GRACE's part: what a user's class writes --------------------------------------
    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Tensors, Any]:
        """Encode one learner's vector ``tensor`` of message ``name``: the payload tensors
        it sends and a context that :meth:`decompress` needs (and every learner knows)."""
        raise NotImplementedError(f"{type(self).__name__} has no compress method")

    def decompress(self, tensors: Tensors, ctx: Any) -> torch.Tensor:
        """The dense vector a payload stands for (with any learner's ``ctx``)."""
        raise NotImplementedError(f"{type(self).__name__} has no decompress method")

    def aggregate(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Combine the learners' decompressed vectors: their sum (GRACE's default; the
        drivers divide by the number of learners when ``average``)."""
        return sum(tensors[1:], tensors[0].clone())

    # --- gradstat's part: defaults for a user's class ----------------------------------
    def memory(self) -> Memory:
        """A fresh error-feedback memory for this compressor: none (GRACE's default)."""
        return NoMemory()

    def describe(self, ctx: Any) -> Mapping[str, float]:
        """Numbers of one payload a replay record shows (``threshold``, ``stages``)."""
        return {}

    def settings(self) -> dict[str, float]:
        """The configuration a user would set to reproduce this compressor."""
        return {} if self.k is None else {"k": self.k}

    def work(self, numel: int, memory: Memory) -> Work:
        """One learner's work per step on a message of ``numel`` elements with
        ``memory``, for the cost model on another target
        (:mod:`gradstat.compressors.work`): by default the memory's passes plus a read of
        the vector and a write and read of a payload of ``k`` (sparsifiers) or ``numel``
        values."""
        return generic_work(self, memory, numel)

    # --- the exchange -------------------------------------------------------------------
    def own(self, tensors: Tensors, ctx: Any) -> torch.Tensor | SparseRow:
        """What this learner contributed: its own payload decoded (flat)."""
        return self.decompress(tensors, ctx).reshape(-1)

    def combine(self, payloads: Sequence[Tensors], ctx: Any, n: int) -> torch.Tensor | SparseRow:
        """The aggregate of every learner's gathered payload: each decoded into a fresh
        vector (an in-place ``aggregate`` changes no one's data), aggregated, divided by
        ``n`` when ``average``."""
        decoded = [self.decompress(list(q), ctx).reshape(-1) for q in payloads]
        total = self.aggregate(decoded).reshape(-1)
        return total / n if self.average else total

    def reduced(self, summed: Tensors, ctx: Any, n: int) -> torch.Tensor:
        """The aggregate of all-reduced payload tensors: decoded once, / n if ``average``."""
        total = self.decompress(summed, ctx).reshape(-1).to(torch.float32)
        return total / n if self.average else total

    def counted(self, tensors: Tensors, numel: int) -> tuple[int, torch.Tensor | None]:
        """Values on the wire and the indices sent (``sparse``, or from the payload)."""
        if self.sparse:
            return int(tensors[0].numel()), tensors[0].reshape(-1)
        if self.sparse is False:
            return numel, None
        return payload_count(tensors)

    def exchange(self, p: torch.Tensor, call: Call) -> Exchange:
        """One learner's step on its corrected vector ``p`` of one message (GRACE's
        ``Communicator.step``): compress, all-gather (or all-reduce) the payload, decode
        and aggregate (once for every learner in the replay)."""
        if self.draws:
            self.generator = call.generator()
        tensors, ctx = self.compress(p, call.name)
        tensors = list(tensors)
        n, collective = call.learners, self.collective
        if collective == "allreduce":
            summed = yield AllReduce(tensors)
            estimate = yield Shared(self.reduced, (summed, ctx, n))
        else:
            gathered = yield AllGather(tensors)
            estimate = yield Shared(self.combine, (gathered, ctx, n))
        selected, indices = self.counted(tensors, p.numel())
        transfer = Transfer(collective, sum(nbytes(t) for t in tensors))
        info = dict(self.describe(ctx))
        sent = lambda: self.own(tensors, ctx)  # noqa: E731 (made when asked for)
        return Sent(sent, estimate, (transfer,), selected, indices, info, tensors, ctx)
