"""The compressor protocol: one class per compressor, in GRACE's shape.

Modelled on GRACE (Xu et al. 2021, "GRACE: A Compressed Communication Framework for
Distributed Machine Learning"): a compressor encodes one learner's tensor
(:meth:`Compressor.compress`), decodes a payload (:meth:`Compressor.decompress`) and
combines the decoded payloads of every learner (:meth:`Compressor.aggregate`); its
error-feedback memory (:mod:`gradstat.compressors.memory`) and the collective that moves
the payloads are separate. A plain GRACE class (``compress`` and ``decompress``, maybe
``aggregate``) runs everywhere a built-in does, with these defaults:

* ``collective = "allgather"``: every learner's payload tensors are gathered, each is
  decompressed and :meth:`~Compressor.aggregate` combines them (their sum); with
  ``average = True`` (GRACE's flag) the sum is divided by the number of learners.
  ``"allreduce"``: the payload tensors are summed element-wise, then decompressed once
  (for payloads that add up: casts, the dense baseline).
* Bytes on the wire are the payload tensors' sizes (:func:`~gradstat.compressors.exchange.nbytes`).
* ``sparse``: ``True`` when ``tensors[0]`` of a payload holds the indices sent (the
  elements selected and the build-up of an all-gather are counted from them);
  ``False`` for dense payloads (every element sent, no build-up); ``None`` (the default)
  measures both from the decompressed tensor's non-zeros.
* :meth:`~Compressor.memory`: residual error feedback; :meth:`~Compressor.work`: the
  cost model's count of one learner's work (a generic estimate from the payload).

Compressors that need every learner at once (CLT-k's leader, gTop-k's tree, PowerSGD's
two all-reduces, random-k's shared draw) and built-ins with a faster streamed form
override the two exchange forms the drivers call:

* :meth:`~Compressor.stream`: the replay form, a
  :class:`~gradstat.compressors.exchange.Stream` fed one learner's row at a time (the
  replay never holds every learner's row);
* :meth:`~Compressor.online`: the DDP communication hook's form, one learner's step with a
  :class:`~gradstat.compressors.communicator.Communicator` (``torch.distributed``).

Each learner has its own compressor object, in the replay as in training (the registry's
``Scheme.for_learner``), so a compressor's state (random streams, adaptive stages) is the
learner's own. docs/compressors.md describes what each driver does with the protocol.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from gradstat.compressors.exchange import OnlineStep, Stream, Tensors

if TYPE_CHECKING:
    from gradstat.compressors.communicator import Communicator
    from gradstat.compressors.memory import Memory
    from gradstat.compressors.work import Work


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


class Compressor:
    """A gradient compressor, one learner's view (see the module docstring).

    Class attributes a subclass may set: ``name`` (its label), ``collective``
    (``"allgather"`` or ``"allreduce"`` for the default exchange; built-ins with their own
    exchange name theirs, e.g. ``"broadcast+allreduce"``), ``average``, ``sparse`` and
    ``k`` (the target elements per learner of a sparsifier, ``None`` for dense ones).
    """

    name: str = ""
    collective: str = "allgather"
    average: bool = True
    sparse: bool | None = None
    k: int | None = None

    # --- GRACE's part: what a user's class writes --------------------------------------
    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Tensors, Any]:
        """Encode one learner's flat vector ``tensor`` (of scope ``name``): the payload
        tensors it sends and a context that :meth:`decompress` needs (and every learner
        knows: shapes, sizes)."""
        raise NotImplementedError(f"{type(self).__name__} has no compress method")

    def decompress(self, tensors: Tensors, ctx: Any) -> torch.Tensor:
        """The dense vector a payload stands for (with any learner's ``ctx``)."""
        raise NotImplementedError(f"{type(self).__name__} has no decompress method")

    def aggregate(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Combine the learners' decompressed vectors: their sum (GRACE's default; the
        drivers divide by the number of learners when ``average``)."""
        return sum(tensors[1:], tensors[0].clone())

    @property
    def sums_payloads(self) -> bool:
        """Whether :meth:`aggregate` is the default sum, which a driver may keep as a
        running sum instead of holding every learner's decompressed vector."""
        return type(self).aggregate is Compressor.aggregate

    # --- gradstat's part: defaults for a user's class ----------------------------------
    def memory(self) -> Memory:
        """A fresh error-feedback memory for this compressor: residual by default."""
        from gradstat.compressors.memory import ResidualMemory

        return ResidualMemory()

    def describe(self, ctx: Any) -> Mapping[str, float]:
        """Numbers of one payload a replay record shows (``threshold``, ``stages``)."""
        return {}

    def settings(self) -> dict[str, float]:
        """The configuration a user would set to reproduce this compressor."""
        return {} if self.k is None else {"k": self.k}

    def work(self, numel: int, memory: Memory) -> Work:
        """One learner's work per step on a scope of ``numel`` elements with ``memory``,
        for the cost model (:mod:`gradstat.compressors.work`): by default the memory's
        passes plus a read of the vector and a write and read of a payload of
        ``k`` (sparsifiers) or ``numel`` values."""
        from gradstat.compressors.work import generic_work

        return generic_work(self, memory, numel)

    # --- the exchange forms the drivers call -------------------------------------------
    def stream(self, scheme: Any, name: str, learners: int, numel: int) -> Stream:
        """The replay form of ``scheme`` (this compressor, one object per learner, and its
        memory, allocated) on scope ``name`` for ``learners`` rows of ``numel`` values:
        the generic GRACE step, or for a class with an ``online`` form of its own and no
        ``stream``, that form run for every learner against a simulated communicator
        (:mod:`gradstat.compressors.simulated`)."""
        if type(self).online is not Compressor.online:
            from gradstat.compressors.simulated import OnlineStream

            return OnlineStream(scheme, name, learners, numel)
        from gradstat.compressors.streams import LocalStream

        return LocalStream(scheme, name, learners, numel)

    def online(self, p: torch.Tensor, name: str, comm: Communicator) -> OnlineStep:
        """One learner's step in training: compress its corrected vector ``p``, exchange
        through ``comm`` with the collective, decompress and aggregate."""
        from gradstat.compressors.online import local_online

        return local_online(self, p, name, comm)
