"""The work model: what one learner's compression costs on another machine (an estimate).

On the analysis machine compression is measured (:mod:`gradstat.analysis.pricing`); for
another ``--target`` each compressor counts its own *work* per learner and message (its
``work(numel, memory)`` method, :class:`Work`, from the operations its module performs;
a memory's passes are ``memory.work(numel)``; a class without a model of its own, a
user's, gets the generic :func:`generic_work`), and :func:`seconds` times that work with
a :class:`~gradstat.compressors.targets.Target`:

    t = (bytes / bandwidth + topk_in / topk_rate + topk_out * topk_per_selected
        + sort / sort_rate + randperm / randperm_rate + compare / compare_rate
        + compact / compact_rate + random / random_rate
        + max(mm_flops / flops, mm_bytes / matmul_bandwidth)) * CALIBRATION
        + launches * launch

Counts are in elements of the message (``d``), ``k`` selected elements and float32
values (4 bytes). A pass is one read or one write of a float32 vector (``4d`` bytes); an
element-wise binary op such as ``p = g + m`` costs 3 passes. Work is split by who does
it: ``local`` (compensate, encode, memory update), ``shared`` (the same on every learner:
CLT-k's leader top-k, random-k's permutation, PowerSGD's orthogonalisation) and
``per_payload`` (decoding one received payload: all-gathers one per learner, all-reduces
one, gTop-k one merge per tree level). :meth:`Work.online` is one learner's work in
training with ``n`` learners; benchmarks/cost_model.py calibrates it against the price
measured here (docs/replay.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gradstat.compressors.targets import Target

#: Bytes of one float32 value and of one index.
F = 4
I = 4  # noqa: E741 (the index size, as in the formulas of docs/replay.md)


@dataclass(frozen=True)
class Ops:
    """Counts of work (see the module docstring for the time formula)."""

    bytes: float = 0.0
    topk_in: float = 0.0
    topk_out: float = 0.0
    sort: float = 0.0
    randperm: float = 0.0
    compare: float = 0.0
    compact: float = 0.0
    random: float = 0.0
    mm_flops: float = 0.0
    mm_bytes: float = 0.0
    launches: float = 0.0

    def __add__(self, other: Ops) -> Ops:
        return Ops(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def __mul__(self, factor: float) -> Ops:
        return Ops(*(getattr(self, f.name) * factor for f in fields(self)))

    __rmul__ = __mul__


#: Measured / counted work on the calibration CPU (benchmarks/cost_model.py: median over
#: every compressor at 2^18, 2^20 and 2^21 elements: 1.3 to 2.5 in five runs on the shared
#: 2-core machine, the profile's rates moving with the load; 1.8 is their middle). The
#: counts are the arithmetic passes; temporaries, dtype conversions and dispatch add about
#: as much again. Applied to every profile: the missing work is memory traffic on any
#: machine.
CALIBRATION = 1.8


def seconds(ops: Ops, target: Target) -> float:
    """Time of ``ops`` on ``target``: the formula of the module docstring times
    :data:`CALIBRATION` (launch costs are not scaled)."""
    return ops.launches * target.launch + CALIBRATION * (
        ops.bytes / target.bandwidth
        + ops.topk_in / target.topk_rate
        + ops.topk_out * target.topk_per_selected
        + ops.sort / target.sort_rate
        + ops.randperm / target.randperm_rate
        + ops.compare / target.compare_rate
        + ops.compact / target.compact_rate
        + ops.random / target.random_rate
        + max(ops.mm_flops / target.flops, ops.mm_bytes / target.matmul_bandwidth)
    )


def passes(count: float, d: int, launches: float = 1.0) -> Ops:
    """``count`` float32 passes over ``d`` elements."""
    return Ops(bytes=count * F * d, launches=launches)


def topk(d: int, k: int) -> Ops:
    """|x| (2 passes) then a top-k selection of ``k`` of ``d``."""
    return passes(2, d, 2) + Ops(topk_in=d, topk_out=k)


def scatter(k: float) -> Ops:
    """Scatter ``k`` (index, value) pairs into a dense vector (random access)."""
    return Ops(bytes=k * (I + 2 * F), launches=1)


@dataclass(frozen=True)
class Work:
    """One compressor's work per learner and step, split by who does it."""

    local: Ops
    shared: Ops
    per_payload: Ops
    #: how many payloads one learner decodes in training: ``n`` (all-gather), ``1``
    #: (all-reduce) or ``log2 n`` (gTop-k's merges on a learner's path).
    received: str

    def payloads_online(self, n: int) -> float:
        if self.received == "all":
            return float(n)
        if self.received == "tree":
            return float(math.ceil(math.log2(n))) if n > 1 else 0.0
        return 1.0

    def online(self, n: int) -> Ops:
        """One learner's work in training with ``n`` learners. Received payloads are
        decoded together (one batch of kernels, as the hooks do), so their launches count
        once."""
        payloads = replace(
            self.per_payload * self.payloads_online(n), launches=self.per_payload.launches
        )
        return self.local + self.shared + payloads


def pack_bits_ops(d: int) -> Ops:
    """pack_bits: codes to int32 (1.25), pad (2), shift (2), sum of groups (1)."""
    return passes(6.25, d, 5)


def unpack_bits_ops(d: int) -> Ops:
    """unpack_bits: expand each byte to int32 codes (1.25), mask (2), to float (2)."""
    return passes(5.25, d, 4)


def generic_work(compressor: Any, memory: Any, d: int) -> Work:
    """The work of a compressor with no model of its own (a user's class): the memory's
    passes, a read of the vector, and a payload of ``k`` values (sparsifiers) or ``d``
    written and, per received payload, read and scattered (sparse) or added (dense)."""
    k = compressor.k
    if k is None:
        encode, decode = passes(2, d, 2), passes(2, d, 1)
    else:
        encode, decode = passes(1, d, 2) + Ops(topk_in=d, topk_out=k), scatter(k)
    return Work(memory.work(d) + encode, Ops(), decode, "all")
