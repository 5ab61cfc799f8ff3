"""The work model: what one learner's compression costs, timed on a target profile.

A compressor's time on the training machine is not the time it took on the analysis
machine. This module counts each compressor's *work* per learner and step, from the
operations the implementation performs (``gradstat/compressors/*``, the same code the DDP
hooks run), and :func:`seconds` times that work with a :class:`~gradstat.compressors.
targets.Target`:

    t = (bytes / bandwidth + topk_in / topk_rate + topk_out * topk_per_selected
        + sort / sort_rate + randperm / randperm_rate + compare / compare_rate
        + compact / compact_rate + random / random_rate
        + max(mm_flops / flops, mm_bytes / matmul_bandwidth)) * CALIBRATION
        + launches * launch

Counts are in elements of the scope (``d``), ``k`` selected elements and float32 values
(4 bytes). A pass is one read or one write of a float32 vector (``4d`` bytes); an
element-wise binary op such as ``p = g + m`` costs 3 passes.

Work is split by who does it, because the replay and training differ there:

* ``local``: every learner, every step (compensate, encode, memory update);
* ``shared``: work the replay does once for all learners but every learner does in
  training (CLT-k's leader top-k, which every learner waits for; random-k's permutation;
  PowerSGD's orthogonalisation and reconstruction);
* ``per_payload``: decoding one received payload (all-gathers: one per learner;
  all-reduces: one; gTop-k: one merge per tree level);
* ``replay_extra``: the replay's own bookkeeping per learner (it stacks every learner's
  dense contribution and averages them; it counts the union of sparse sets), which
  training does not do.

:meth:`Work.online` is one learner's time in training with ``n`` learners;
:meth:`Work.replay` predicts the replay's measured ``compress_seconds`` (all learners'
work divided by ``n``), which is how the model is calibrated (benchmarks/cost_model.py,
docs/replay.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

from gradstat.compressors.estimated import EstimatedSparsifier
from gradstat.compressors.legacy import Compressor
from gradstat.compressors.memory import DGCMemory, NoMemory, ResidualMemory
from gradstat.compressors.powersgd import PowerSGD
from gradstat.compressors.quantize import QSGD, Cast, NoCompression, SignSGD, TernGrad
from gradstat.compressors.sparse import CLTK, GTopK, RandomK, TopK
from gradstat.compressors.targets import Target

#: Bytes of one float32 value and of one index.
F = 4
I = 4  # noqa: E741 (the index size, as in the formulas of docs/replay.md)

#: (float32 passes, comparisons, compactions) of each threshold estimator
#: (gradstat/stats/thresholds.py, chunked): |x| is 2 passes, a reduction 1, a count 2
#: passes + 1 comparison, an exceedance 2 passes + 1 comparison + 1 compaction; then the
#: compressor's mask |p| > eta (2 passes + 1 comparison) and nonzero (1 compaction).
ESTIMATOR_OPS = {
    "sidco-exp": (6 + 2 + 2, 1 + 1 + 1, 1 + 1),
    "sidco-gpd": (6 + 2 + 2, 1 + 1 + 1, 1 + 1),
    "sidco-gamma-gpd": (11 + 2 + 2, 1 + 1 + 1, 1 + 1),
    "dgc": (3 + 2 + 2, 1 + 1, 1 + 1),
    "gaussiank": (4 + 3 + 2 * 2 + 2, 2 + 1, 1),
    "redsync": (3 + 4 + 2 + 4 * 2 + 2 + 2, 1 + 4 + 1 + 1, 1 + 1),
    # RedSync's search seeded by a SIDCo estimate: taken as RedSync's (not calibrated)
    "redsync-sidco": (3 + 4 + 2 + 4 * 2 + 2 + 2, 1 + 4 + 1 + 1, 1 + 1),
    "hard": (2 + 2, 1 + 1, 1),
}


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
    replay_extra: Ops
    #: how many payloads one learner decodes in training: ``n`` (all-gather), ``1``
    #: (all-reduce) or ``log2 n`` (gTop-k's merges on a learner's path).
    received: str

    def payloads_online(self, n: int) -> float:
        if self.received == "all":
            return float(n)
        if self.received == "tree":
            return float(math.ceil(math.log2(n))) if n > 1 else 0.0
        return 1.0

    def payloads_replay(self, n: int) -> float:
        """Payloads the replay decodes per learner (it aggregates once for everyone)."""
        if self.received == "tree":
            return (n - 1) / n
        return 1.0

    def online(self, n: int) -> Ops:
        """One learner's work in training with ``n`` learners. Received payloads are
        decoded together (one batch of kernels, as the hooks do), so their launches count
        once."""
        payloads = replace(
            self.per_payload * self.payloads_online(n), launches=self.per_payload.launches
        )
        return self.local + self.shared + payloads

    def replay(self, n: int) -> Ops:
        """The replay's work per learner with ``n`` replayed learners."""
        return (
            self.local
            + self.shared * (1.0 / n)
            + self.per_payload * self.payloads_replay(n)
            + self.replay_extra
        )


def memory_ops(memory: Any, d: int) -> Ops:
    """Compensate and update of an error-feedback memory (module docstring of memory.py)."""
    if isinstance(memory, NoMemory):
        return Ops()
    if isinstance(memory, DGCMemory):
        # u = mu u + g (3), v += u (3); v = p - c (3); mask c != 0; 2 masked fills
        return passes(3 + 3 + 3 + 2 * 2.25, d, 6) + Ops(compare=d)
    assert isinstance(memory, ResidualMemory)
    extra = 0 if memory.beta == 1.0 else 3
    return passes(3 + 3 + extra, d, 2 + (extra > 0))


def _pack_bits(d: int) -> Ops:
    """pack_bits: codes to int32 (1.25), pad (2), shift (2), sum of groups (1)."""
    return passes(6.25, d, 5)


def _unpack_bits(d: int) -> Ops:
    """unpack_bits: expand each byte to int32 codes (1.25), mask (2), to float (2)."""
    return passes(5.25, d, 4)


def compressor_work(compressor: Compressor, memory: Any, d: int) -> Work:
    """The :class:`Work` of ``compressor`` with ``memory`` on a scope of ``d`` elements."""
    mem = memory_ops(memory, d)
    k = compressor.k or d
    # the replay stacks every learner's dense contribution (2) and averages them (1)
    stack = passes(3, d, 2)
    # a dense zero vector, then the sparse pairs scattered into it
    zeros = passes(1, d)
    union = Ops(sort=k, launches=2)
    if isinstance(compressor, NoCompression):
        return Work(Ops(), Ops(), Ops(), stack, "one")
    if isinstance(compressor, Cast):
        return Work(mem + passes(1.5, d), Ops(), passes(1.5, d), stack, "one")
    if isinstance(compressor, TopK):
        return Work(mem + topk(d, k) + zeros, Ops(), scatter(k), stack + union, "all")
    if isinstance(compressor, EstimatedSparsifier):
        count, compare, compact = ESTIMATOR_OPS[compressor.estimator]
        local = mem + passes(count, d, 20) + Ops(compare=compare * d, compact=compact * d)
        if compressor.estimator == "dgc":
            sample = min(d, max(math.ceil(0.01 * d), math.ceil(2.0 / compressor.ratio)))
            local += Ops(random=sample, topk_in=sample, topk_out=sample * compressor.ratio)
        return Work(local + zeros, Ops(), scatter(k), stack + union, "all")
    if isinstance(compressor, RandomK):
        local = mem + zeros + scatter(k)
        return Work(local, Ops(randperm=d, launches=1), scatter(k), Ops(), "one")
    if isinstance(compressor, CLTK):
        local = mem + zeros + scatter(k)
        return Work(local, topk(d, k), scatter(k), Ops(), "one")
    if isinstance(compressor, GTopK):
        # a merge: unique (sort) of 2k indices, a top-k of up to 2k sums, isin on k
        merge = Ops(sort=3 * k, topk_in=2 * k, topk_out=k, bytes=2 * k * 3 * (I + F), launches=8)
        return Work(mem + topk(d, k) + zeros + scatter(k), Ops(), merge, passes(1, d), "tree")
    if isinstance(compressor, PowerSGD):
        return _powersgd_work(compressor, mem, d)
    if isinstance(compressor, SignSGD):
        # scale: |p| mean (3); p >= 0 (1 comparison) packed; decode: unpack, 2 s - 1 (4),
        # times the scale (2); signSGD's majority vote: sign (2) and sum (1) per payload
        encode = mem + passes(3, d, 2) + Ops(compare=d) + _pack_bits(d)
        decode = _unpack_bits(d) + passes(6 + (3 if compressor.majority else 0), d, 3)
        return Work(encode, Ops(), decode, stack, "all")
    if isinstance(compressor, QSGD):
        # pad (2), bucket norms (1), |p| (2), / norm (3), x s (2), noise, + (3), floor (2),
        # clamp (2), sign (2), x (3), to int8 (1.25); decode: to float, pad, x norm, / s
        encode = mem + passes(23.25, d, 12) + Ops(random=d)
        return Work(encode, Ops(), passes(10.25, d, 4), stack, "all")
    if isinstance(compressor, TernGrad):
        # |p| max (3), |p| / s (4), noise < prob (1 read + comparison), sign (2), x (3),
        # to int32 + 1 (4), packed; decode: unpack, -1 (2), to float (2), x s (2)
        encode = mem + passes(17, d, 10) + Ops(random=d, compare=d) + _pack_bits(d)
        return Work(encode, Ops(), _unpack_bits(d) + passes(6, d, 3), stack, "all")
    raise ValueError(f"no work model for {type(compressor).__name__}")


def _powersgd_work(compressor: PowerSGD, mem: Ops, d: int) -> Work:
    """Per matrix a x b at rank r: P = M Q and Q = M^T P (4abr FLOP, M read twice) per
    learner; QR of P (about 4 a r^2), M_hat = P Q^T (2abr) and copying it into the
    estimate (3 passes) by everyone in training, once in the replay."""
    r = compressor.rank
    local, shared = mem, passes(1, d)
    for _, a, b in compressor.matrices:
        local += Ops(mm_flops=4 * a * b * r, mm_bytes=2 * F * a * b, launches=4)
        shared += Ops(mm_flops=2 * a * b * r + 4 * a * r * r, bytes=3 * F * a * b, launches=6)
    for _, numel in compressor.dense:
        shared += passes(3, numel)
    return Work(local, shared, Ops(), Ops(), "one")
