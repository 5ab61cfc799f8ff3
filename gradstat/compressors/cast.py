"""Number formats as compressors: ``bf16``, ``fp16``, ``fp8-e4m3``, ``fp8-e5m2``,
``mxfp8``, ``mxfp6``, ``mxfp4`` sent through the collective as it runs, hop by hop
(:mod:`gradstat.wire.formats`, :mod:`gradstat.wire.collectives`), with
``:algorithm=ring|tree|a2a`` and ``:accumulate=fp32|wire`` (docs/lowprecision.md): an
all-reduce, or at ``unit`` granularity (FSDP2) a reduce-scatter.

The exchange all-gathers every learner's float32 message and runs the emulated
collective on it (a :class:`~gradstat.compressors.exchange.Shared` step: once in the
replay, on every learner in training, the same bits). The bytes recorded are the
format's on the wire (:meth:`FormatCompressor.wire_bytes`), not the emulation's; what a
learner ``sent`` is its message as it leaves it (:meth:`FormatCompressor.own`).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from gradstat.compressors.base import Compressor, Exchange
from gradstat.compressors.exchange import AllGather, Call, Sent, Shared, Tensors, Transfer
from gradstat.compressors.memory import Memory
from gradstat.compressors.work import Ops, Work, passes
from gradstat.wire.collectives import ACCUMULATE, ALGORITHMS, all_reduce, reduce_scatter
from gradstat.wire.formats import Format, wire_format

#: The collectives a format's exchange emulates.
ALLREDUCE, REDUCESCATTER = "allreduce", "reducescatter"


class FormatCompressor(Compressor):
    """One learner's message sent in ``fmt`` through the emulated collective."""

    sparse = False
    emulated = True

    def __init__(self, fmt: Format, algorithm: str = "ring", accumulate: str = "fp32") -> None:
        self.fmt, self.algorithm, self.accumulate = fmt, algorithm, accumulate
        self.name = fmt.name
        self.collective = ALLREDUCE

    # GRACE's part, for a driver that moves payloads itself: the whole message in fmt
    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Tensors, Any]:
        flat = tensor.reshape(-1).to(torch.float32)
        return self.fmt.encode(flat), flat.numel()

    def decompress(self, tensors: Tensors, ctx: Any) -> torch.Tensor:
        return self.fmt.decode(tuple(tensors), ctx)

    def work(self, numel: int, memory: Memory) -> Work:
        encode = memory.work(numel) + passes(1.5, numel)
        return Work(encode, Ops(), passes(1.5, numel), "one")

    def chunks(self, numel: int, learners: int) -> list[int]:
        """The collective's chunk lengths of a message of ``numel`` values."""
        size = -(-numel // learners)
        return [max(0, min(size, numel - c * size)) for c in range(learners)]

    def wire_bytes(self, numel: int, learners: int) -> int:
        """Bytes one learner's message takes on the wire: its chunks, each one message
        of the format (fp8: a scale each; MX: blocks from each chunk's start)."""
        return sum(self.fmt.wire_bytes(c) for c in self.chunks(numel, learners) if c)

    def aggregate(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The emulated collective's sum of the learners' vectors (``compare`` applies it
        to the recorded ``sent`` rows: each learner's chunks already rounded once)."""
        return self.reduce([(t.reshape(-1),) for t in tensors], 1)

    def reduce(self, gathered: Sequence[Tensors], n: int) -> torch.Tensor:
        """The emulated collective over the learners' gathered float32 messages: the
        mean every learner holds (all-reduce) or the owners' chunks end to end
        (reduce-scatter)."""
        rows = torch.stack([g[0].reshape(-1) for g in gathered])
        settings = {"wire": self.fmt, "algorithm": self.algorithm, "accumulate": self.accumulate}
        if self.collective == REDUCESCATTER:
            total = torch.cat(reduce_scatter(rows, **settings))
        else:
            total = all_reduce(rows, **settings)
        return total / n

    def own(self, flat: torch.Tensor, learners: int, learner: int) -> torch.Tensor:
        """The message as it leaves ``learner``: each chunk rounded once by the format,
        except (``accumulate=fp32``) the chunk the learner owns, which it adds to what
        it receives unrounded (in ``wire`` mode the inputs are in the format)."""
        size = -(-flat.numel() // learners)
        padded = torch.zeros(learners * size)
        padded[: flat.numel()] = flat
        chunks = padded.view(learners, size)
        rounded = self.fmt.round(chunks)
        if self.accumulate == "fp32":
            rounded[learner] = chunks[learner]
        return rounded.reshape(-1)[: flat.numel()]

    def exchange(self, p: torch.Tensor, call: Call) -> Exchange:
        flat = p.reshape(-1).to(torch.float32)
        n = call.learners
        gathered = yield AllGather([flat])
        estimate = yield Shared(self.reduce, (gathered, n))
        sent = partial(self.own, flat, n, call.learner)
        transfers = self.transfers(float(self.wire_bytes(flat.numel(), n)))
        return Sent(sent, estimate, transfers, flat.numel(), None, {}, (flat,), None)

    def transfers(self, nbytes: float) -> tuple[Transfer, ...]:
        """The collectives the cost model prices: a ring or all-to-all all-reduce (or
        reduce-scatter) of the message, or by ``tree`` a binomial-tree reduce (and for an
        all-reduce a broadcast back)."""
        if self.algorithm != "tree":
            return (Transfer(self.collective, nbytes),)
        if self.collective == REDUCESCATTER:
            return (Transfer("reduce", nbytes),)
        return Transfer("reduce", nbytes), Transfer("broadcast", nbytes)


def build(ctx: Any) -> Compressor:
    """The format compressor ``ctx.name`` with the context's ``algorithm`` and
    ``accumulate``; a reduce-scatter on a ``unit`` plan (FSDP2), else an all-reduce."""
    params = ctx.params
    algorithm = ALGORITHMS[int(params.get("algorithm", 0))]
    accumulate = ACCUMULATE[int(params.get("accumulate", 0))]
    made = FormatCompressor(wire_format(ctx.name), algorithm, accumulate)
    if ctx.granularity == "unit":
        made.collective = REDUCESCATTER
    return made
