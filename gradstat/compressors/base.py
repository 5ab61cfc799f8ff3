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
* Bytes on the wire are the payload tensors' sizes (:func:`nbytes`).
* ``sparse``: ``True`` when ``tensors[0]`` of a payload holds the indices sent (the
  elements selected and the build-up of an all-gather are counted from them);
  ``False`` for dense payloads (every element sent, no build-up); ``None`` (the default)
  measures both from the decompressed tensor's non-zeros.
* :meth:`~Compressor.memory`: residual error feedback; :meth:`~Compressor.work`: the
  cost model's count of one learner's work (a generic estimate from the payload).

Compressors that need every learner at once (CLT-k's leader, gTop-k's tree, PowerSGD's
two all-reduces, random-k's shared draw) and built-ins with a faster streamed form
override the two exchange forms the drivers call:

* :meth:`~Compressor.stream`: the replay form, a :class:`Stream` fed one learner's row at a
  time (the replay never holds every learner's row);
* :meth:`~Compressor.online`: the DDP communication hook's form, one learner's step with a
  :class:`~gradstat.compressors.communicator.Communicator` (``torch.distributed``).

Each learner has its own compressor object, in the replay as in training (the registry's
``Scheme.for_learner``), so a compressor's state (random streams, adaptive stages) is the
learner's own. docs/compressors.md describes what each driver does with the protocol.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from gradstat.compressors.communicator import Communicator
    from gradstat.compressors.memory import Memory
    from gradstat.compressors.work import Work

#: A payload: the tensors one learner puts on the wire.
Tensors = Sequence[torch.Tensor]
#: ``read_row(i)``: learner i's gradient row of the step (for a stream that needs it early).
ReadRow = Callable[[int], torch.Tensor]


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


@dataclass(frozen=True)
class SparseRow:
    """A row that is zero outside ``indices`` (distinct), with ``values`` there: the mean
    of what the learners of a sparsifier sent, kept without a dense row of ``numel``
    values (a dense aggregate is one more row per compressor, zeroed, added into,
    divided and read again every step: 128 MB at 32M values)."""

    numel: int
    indices: torch.Tensor
    values: torch.Tensor

    def dense(self) -> torch.Tensor:
        """The row as a dense tensor (the same numbers as a dense aggregate)."""
        row = torch.zeros(self.numel, dtype=self.values.dtype, device=self.values.device)
        row[self.indices] = self.values
        return row


@dataclass
class StepOutcome:
    """What one replayed step of all learners produced.

    ``estimate``: the aggregate every learner holds (dense, or a :class:`SparseRow`);
    ``transfers``: the collectives with the bytes each learner puts in; ``selected[i]``:
    how many elements learner i sent; ``memory_norm``: mean over learners of the memory's
    norm after the step; ``union``: non-zeros of a sparse aggregate (build-up), ``None``
    for dense ones; ``gathered_bytes``: what each learner holds after an all-gather;
    ``info``: per-payload numbers averaged over learners (``threshold``, ``stages``);
    ``multiplicity``: for all-gathered sparse sets, h(c), c = 1..n, how many coordinates
    exactly c learners sent (:func:`gradstat.stats.topk_sets.buildup_curve`).
    """

    estimate: torch.Tensor | SparseRow
    transfers: tuple[Transfer, ...]
    selected: list[int]
    memory_norm: float
    union: int | None = None
    gathered_bytes: float | None = None
    info: dict[str, float] = field(default_factory=dict)
    multiplicity: list[int] | None = None

    @property
    def bytes_per_learner(self) -> float:
        return sum(t.nbytes for t in self.transfers)


@dataclass
class OnlineStep:
    """One learner's outcome of one training step: what it contributed (``sent``, dense;
    its memory keeps ``p - sent``), what everyone holds (``estimate``), the bytes it put
    into each collective, how many elements it sent, and ``overhead_bytes`` beyond the
    payload (all-gather padding and lengths, gTop-k's node counts)."""

    sent: torch.Tensor
    estimate: torch.Tensor
    transfers: tuple[Transfer, ...]
    selected: int
    overhead_bytes: int = 0

    @property
    def payload_bytes(self) -> float:
        return sum(t.nbytes for t in self.transfers)


class Stream:
    """One scheme's replay step, fed one learner's row at a time (learners 0..n-1).

    ``begin(read_row)`` starts a step (``read_row(i)`` reads learner i's row of the
    scope, for a method that needs a row before its turn, e.g. CLT-k's leader);
    ``learner(i, g)`` feeds learner i's gradient row; ``finish()`` ends the step. The
    stream owns the step's arithmetic; the memory (``Memory``) owns the rows kept.
    """

    def begin(self, read_row: ReadRow) -> None:
        """Start a step."""

    def learner(self, i: int, g: torch.Tensor) -> None:
        """Feed learner i's gradient row."""
        raise NotImplementedError

    def finish(self) -> StepOutcome:
        """End the step: the aggregate and what travelled."""
        raise NotImplementedError


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
