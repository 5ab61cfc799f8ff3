"""Number formats as compressors: ``bf16``, ``fp16``, ``fp8-e4m3``, ``fp8-e5m2``,
``mxfp8``, ``mxfp6``, ``mxfp4`` on the wire of an emulated collective (issue 37;
docs/lowprecision.md).

A format compressor sends each learner's message in the number format
(:mod:`gradstat.wire.formats`) through the collective as it runs, hop by hop
(:mod:`gradstat.wire.collectives`): ``:algorithm=ring|tree|a2a`` (default
``ring``) and ``:accumulate=fp32|wire`` (default ``fp32``) are its parameters, and every
label states them (``bf16:algorithm=ring:accumulate=fp32``). The collective is an
all-reduce (DDP, the replay's ``model``/``tensor``/``bucket`` plans) or, at ``unit``
granularity (FSDP2), a reduce-scatter whose owners' chunks are the result (FSDP does not
all-gather gradients). No error feedback unless a memory is named (``bf16+residual``).

The exchange is one all-gather of every learner's float32 message and the emulated
collective run on it (a :class:`~gradstat.compressors.exchange.Shared` step): the replay
runs it once for all learners, training (the DDP hook, FSDP's reduce-scatter) on every
learner, so both hold the same bits. The bytes recorded are those the format's
collective puts on the wire (:meth:`FormatCompressor.wire_bytes`), not the emulation's
float32 all-gather. What a learner ``sent`` (for a residual memory and the ``/sent``
rows) is its message as it leaves the learner: each of the collective's N chunks rounded
once by the format, but its own chunk (``accumulate=fp32``: added unrounded where the
learner owns the sum); :meth:`FormatCompressor.aggregate` runs the collective over such
rows (``compare``'s update applied online: exact at N = 2, the roundings of partial sums
further along the ring or tree aside).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from gradstat.compressors.base import Compressor, Exchange
from gradstat.compressors.exchange import AllGather, Call, Sent, Shared, Tensors, Transfer
from gradstat.compressors.memory import Memory, NoMemory
from gradstat.compressors.work import Ops, Work, passes
from gradstat.wire.collectives import ACCUMULATE, ALGORITHMS, all_reduce, reduce_scatter
from gradstat.wire.formats import Format, wire_format

#: The formats registered as compressors (docs/lowprecision.md).
FORMAT_COMPRESSORS = ("bf16", "fp16", "fp8-e4m3", "fp8-e5m2", "mxfp8", "mxfp6", "mxfp4")
#: The parameters every format compressor takes (choice parameters: the index of the
#: word in ALGORITHMS and ACCUMULATE; 0 is ``ring`` and ``fp32``).
FORMAT_PARAMS = {"algorithm": 0.0, "accumulate": 0.0}
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

    def memory(self) -> Memory:
        return NoMemory()

    def work(self, numel: int, memory: Memory) -> Work:
        encode = memory.work(numel) + passes(1.5, numel)
        return Work(encode, Ops(), passes(1.5, numel), "one")

    def settings(self) -> dict[str, float]:
        return {}

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


def build(ctx: Any, name: str) -> Compressor:
    """The format compressor ``name`` with the context's ``algorithm`` and ``accumulate``;
    a reduce-scatter on a ``unit`` plan (FSDP2), else an all-reduce."""
    params = ctx.params
    algorithm = ALGORITHMS[int(params.get("algorithm", 0))]
    accumulate = ACCUMULATE[int(params.get("accumulate", 0))]
    made = FormatCompressor(wire_format(name), algorithm, accumulate)
    if ctx.granularity == "unit":
        made.collective = REDUCESCATTER
    return made
