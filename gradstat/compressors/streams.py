"""The generic replay step of a GRACE-style compressor, fed one learner's row at a time.

Per learner ``i`` (in order 0..n-1): ``p = memory.compensate(g)``; ``tensors, ctx =
compress(p, name)`` with learner i's compressor object; ``sent = decompress(tensors,
ctx)``; ``sent`` is folded into the aggregate and ``memory.update(p, sent)`` keeps the
rest. The aggregate of the default ``aggregate`` (a sum) is a running sum, so beyond the
memories one row is alive; a compressor with an ``aggregate`` of its own is handed every
learner's ``sent`` at the end (n rows). Bytes are the payload tensors' sizes; the elements
sent and the build-up come from ``tensors[0]`` (``sparse = True``), from the decompressed
non-zeros (``sparse = None``) or are every element (``sparse = False``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from gradstat.compressors.base import Compressor

from gradstat.compressors.exchange import StepOutcome, Stream, Tensors, Transfer, nbytes


class LocalStream(Stream):
    """A compressor that encodes each learner alone (see the module docstring)."""

    def __init__(self, scheme: Any, name: str, learners: int, numel: int) -> None:
        self.scheme, self.name = scheme, name
        self.n, self.d = learners, numel
        self.memory = scheme.memory
        self.compressor: Compressor = scheme.compressor
        self.compressors = [scheme.for_learner(i) for i in range(learners)]
        self.own_aggregate = not self.compressor.sums_payloads
        self.total: torch.Tensor | None = None

    def begin(self, read_row: Any) -> None:
        self.sizes: list[int] = []
        self.selected: list[int] = []
        self.indices: list[torch.Tensor] = []
        self.infos: list[dict[str, float]] = []
        self.start_aggregate()

    def start_aggregate(self) -> None:
        """A zero running sum (its row kept from step to step: a fresh one costs its page
        faults), or an empty list for an ``aggregate`` of the compressor's own."""
        if self.own_aggregate:
            self.sent: list[torch.Tensor] = []
        elif self.total is None:
            self.total = torch.zeros(self.d)
        else:
            self.total.zero_()

    def fold(self, sent: torch.Tensor) -> None:
        """Add one learner's decompressed vector to the aggregate."""
        if self.own_aggregate:
            self.sent.append(sent.clone())
        else:
            self.total += sent

    def estimate(self) -> torch.Tensor:
        """The aggregate: ``aggregate`` of the decompressed vectors (or their running
        sum), divided by n when ``average`` (in place: the sum's row is zeroed when the
        next step begins)."""
        if self.own_aggregate:
            total = self.compressor.aggregate(self.sent)
            self.sent = []
        else:
            total = self.total
        return total.div_(self.n) if self.compressor.average else total

    def learner(self, i: int, g: torch.Tensor) -> None:
        p, state = self.memory.compensate(i, g)
        compressor = self.compressors[i]
        tensors, ctx = compressor.compress(p, self.name)
        sent = compressor.decompress(tensors, ctx)
        self.fold(sent)
        self.note(i, tensors, ctx, sent)
        self.memory.update(i, p, sent, state)

    def note(self, i: int, tensors: Tensors, ctx: Any, sent: torch.Tensor | None) -> None:
        """What the cost model, the records and the build-up count need of a payload."""
        self.sizes.append(sum(nbytes(t) for t in tensors))
        sparse = self.compressor.sparse
        if sparse:
            self.indices.append(tensors[0])
            self.selected.append(int(tensors[0].numel()))
        elif sparse is None and sent is not None:
            nonzero = torch.nonzero(sent.reshape(-1)).view(-1)
            self.indices.append(nonzero)
            self.selected.append(int(nonzero.numel()))
        else:
            self.selected.append(self.d)
        self.infos.append(dict(self.compressors[i].describe(ctx)))

    def holders(self) -> torch.Tensor | None:
        """How many learners sent each coordinate any learner sent (sparse payloads)."""
        if not self.indices:
            return None
        return torch.unique(torch.cat([i.long() for i in self.indices]), return_counts=True)[1]

    def finish(self) -> StepOutcome:
        return self.outcome(self.estimate(), self.holders())

    def outcome(self, estimate: Any, holders: torch.Tensor | None) -> StepOutcome:
        """The step's outcome from its aggregate and the learners' payloads noted."""
        union = multiplicity = None
        if holders is not None:
            union = int(holders.numel())
            multiplicity = torch.bincount(holders, minlength=self.n + 1)[1:].tolist()
        collective = self.compressor.collective
        gather = collective == "allgather"
        info = {
            key: sum(info[key] for info in self.infos) / len(self.infos) for key in self.infos[0]
        }
        return StepOutcome(
            estimate=estimate,
            transfers=(Transfer(collective, sum(self.sizes) / len(self.sizes)),),
            selected=self.selected,
            memory_norm=self.memory.norm(),
            union=union,
            gathered_bytes=float(sum(self.sizes)) if gather else None,
            info=info,
            multiplicity=multiplicity if gather else None,
        )
