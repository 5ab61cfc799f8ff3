"""Collectives as they run: reduce-scatter and all-reduce over N learners' inputs with the
reduction algorithm and the number format on every hop (docs/lowprecision.md;
/work/shared/METHODS.md section 7).

Each learner's input (M float32 values) is cut into N chunks of ``C = ceil(M / N)``
values (the last padded with zeros, which change no scale); chunk ``c`` belongs to
learner ``c``. A *message* is one chunk sent by one learner in one hop (all-reduce by
``tree``: the whole vector), and the wire format rounds each message as a whole (one
fp8 scale per message, MX blocks from its start). ``accumulate`` says where sums live:

* ``fp32``: a learner adds what it receives (decoded) to its own float32 input in
  float32; only what goes on the wire is rounded.
* ``wire``: the inputs are in the wire format, and every sum is rounded to it as it is
  made (NCCL on bf16 tensors); what is sent is that payload, not rounded again.

Algorithms (``R``: the wire format's rounding of a message, ``+`` float32 addition):

* ``ring``: N - 1 hops. Chunk ``c`` starts at learner ``c + 1`` and travels the ring to
  its owner ``c``; at each hop the receiver adds its own chunk ``c``:
  ``acc = R(acc) + x`` (fp32) or ``acc = R(acc + R(x))`` (wire). N - 1 roundings of the
  sum per element.
* ``tree``: a binomial tree per chunk rooted at its owner (learner ``v`` counted from the
  owner receives from ``v + 2^l`` at level ``l``): ``acc = acc + R(acc')`` (fp32) or
  ``R(acc + acc')`` (wire); ``ceil(log2 N)`` roundings on the longest path.
* ``a2a``: an all-to-all (each learner sends chunk ``c`` to learner ``c``, once: one
  rounding per input; the owner's own chunk stays local) and a sum by the owner in rank
  order, in float32 (fp32) or rounded after each addition (wire).

All-reduce is reduce-scatter then all-gather (``tree``: reduce of the whole vector to
learner 0, then broadcast); the all-gather sends each owner's result in the wire format,
one rounding in ``fp32`` mode (none in ``wire`` mode: it is a payload already), and every
learner holds the same values. Each hop processes all chunks at once: one pass of the
compiled loop (:mod:`gradstat.wire.hops`), or with ``plain=True`` torch's
operations (the reference: the same bits). ``tests/test_collectives.py`` holds the plain
message-by-message loops that the results equal bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gradstat.errors import UsageError
from gradstat.wire.formats import Format, wire_format
from gradstat.wire.hops import (
    ADD_ROUND,
    ADD_ROUNDED,
    ADD_ROUNDED_ROUND,
    LOAD,
    ROUND,
    ROUND_ADD,
    CompiledHops,
    PlainHops,
    hops_for,
)

Hops = PlainHops | CompiledHops

ALGORITHMS = ("ring", "tree", "a2a")
ACCUMULATE = ("fp32", "wire")


def _stack(inputs: Sequence[torch.Tensor] | torch.Tensor, learners: int) -> torch.Tensor:
    """The inputs as one (N, N * C) float32 tensor, zero-padded (a 2-D float32 tensor
    whose rows already split evenly is used as it is, not copied)."""
    if isinstance(inputs, torch.Tensor) and inputs.ndim == 2:
        numel = inputs.shape[1]
        if inputs.dtype == torch.float32 and numel % learners == 0 and inputs.is_contiguous():
            return inputs
    rows = list(inputs)
    numel = rows[0].numel()
    if any(row.numel() != numel for row in rows):
        raise UsageError("every learner's input must have the same number of values")
    chunk = -(-numel // learners)
    out = torch.zeros(learners, learners * chunk)
    for i, row in enumerate(rows):
        out[i, :numel] = row.reshape(-1)
    return out


def _check(inputs: Sequence[torch.Tensor] | torch.Tensor, algorithm: str, accumulate: str) -> int:
    if algorithm not in ALGORITHMS:
        raise UsageError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    if accumulate not in ACCUMULATE:
        raise UsageError(f"accumulate must be one of {', '.join(ACCUMULATE)}, got {accumulate!r}")
    learners = len(inputs)
    if learners < 1:
        raise UsageError("a collective needs at least one learner's input")
    return learners


def _ring(x: torch.Tensor, hops: Hops, wire: bool) -> torch.Tensor:
    """Ring reduce-scatter of ``x`` (N learners, N chunks, C): (N chunks, C), chunk ``c``
    as its owner holds it."""
    n = x.shape[0]
    chunks = torch.arange(n)
    start = (chunks + 1) % n  # chunk c starts at learner c + 1
    if wire:
        acc = torch.empty(x.shape[1:])
        hops.hop(acc, x, start, -1, LOAD)
    else:  # a copy of views (indexing x[start, chunks] gathers 7x slower)
        acc = torch.stack([x[int(learner), c] for c, learner in enumerate(start)])
    for hop in range(1, n):  # the receiver adds its own chunk c
        hops.hop(acc, x, (start + hop) % n, -1, ADD_ROUNDED_ROUND if wire else ROUND_ADD)
    return acc


def _tree(v: torch.Tensor, hops: Hops, wire: bool) -> torch.Tensor:
    """Binomial-tree reduction of ``v`` (N learners counted from the root, chunks, C;
    summed into in place) to learner 0: (chunks, C)."""
    n, chunks = v.shape[0], v.shape[1]
    if wire:
        rows = v.view(1, n * chunks, -1)
        hops.hop(rows[0], rows, torch.zeros(n * chunks, dtype=torch.int64), -1, ROUND)
    step = 1
    while step < n:
        for receiver in range(0, n - step, 2 * step):
            sender = torch.full((chunks,), receiver + step, dtype=torch.int64)
            hops.hop(v[receiver], v, sender, -1, ADD_ROUND if wire else ADD_ROUNDED)
        step *= 2
    return v[0]


def _a2a(x: torch.Tensor, hops: Hops, wire: bool) -> torch.Tensor:
    """All-to-all then the owners' sums in rank order: (N chunks, C)."""
    n = x.shape[0]
    acc = torch.empty(x.shape[1:])
    for learner in range(n):  # learner's chunk c, sent to learner c (its own stays)
        sender = torch.full((n,), learner, dtype=torch.int64)
        own = -1 if wire else learner
        mode = LOAD if learner == 0 else (ADD_ROUNDED_ROUND if wire else ADD_ROUNDED)
        hops.hop(acc, x, sender, own, mode)
    return acc


def _scatter(x: torch.Tensor, hops: Hops, algorithm: str, wire: bool) -> torch.Tensor:
    """Each owner's chunk of the sum: (N, C), from ``x`` (N learners, N chunks, C)."""
    n = x.shape[0]
    if algorithm == "ring":
        return _ring(x, hops, wire)
    if algorithm == "a2a":
        return _a2a(x, hops, wire)
    # v[k, c]: learner k counted from chunk c's owner, c (a copy of views: fast)
    v = torch.stack([torch.stack([x[(k + c) % n, c] for c in range(n)]) for k in range(n)])
    return _tree(v, hops, wire)


def _prepare(
    inputs: Sequence[torch.Tensor] | torch.Tensor,
    wire: str | Format,
    algorithm: str,
    accumulate: str,
    plain: bool,
) -> tuple[Hops, torch.Tensor, int, bool]:
    """The checked settings' hops, the inputs as (N, N, C), their length M, and whether
    sums are kept in the wire format."""
    learners = _check(inputs, algorithm, accumulate)
    hops = hops_for(wire_format(wire), plain)
    x = _stack(inputs, learners).view(learners, learners, -1)
    return hops, x, inputs[0].numel(), accumulate == "wire"


def reduce_scatter(
    inputs: Sequence[torch.Tensor] | torch.Tensor,
    *,
    wire: str | Format = "fp32",
    algorithm: str = "ring",
    accumulate: str = "fp32",
    plain: bool = False,
) -> list[torch.Tensor]:
    """Each learner's chunk of the element-wise sum of ``inputs`` (N learners' 1-D
    float32 tensors of equal length, or an (N, M) tensor), as its owner holds it after a
    reduce-scatter by ``algorithm`` with ``wire`` on every hop: N float32 tensors,
    chunk ``c`` = values ``c * C .. (c + 1) * C`` of the sum (the last ones shorter).
    ``plain``: run the torch reference instead of the compiled hops (the same bits)."""
    hops, x, numel, wired = _prepare(inputs, wire, algorithm, accumulate, plain)
    owned = _scatter(x, hops, algorithm, wired)
    chunk = owned.shape[1]
    return [owned[c, : max(0, min(chunk, numel - c * chunk))] for c in range(len(owned))]


def all_reduce(
    inputs: Sequence[torch.Tensor] | torch.Tensor,
    *,
    wire: str | Format = "fp32",
    algorithm: str = "ring",
    accumulate: str = "fp32",
    plain: bool = False,
) -> torch.Tensor:
    """The element-wise sum of ``inputs`` that every learner holds after an all-reduce by
    ``algorithm`` (``ring`` and ``a2a``: reduce-scatter + all-gather; ``tree``: reduce to
    learner 0 + broadcast) with ``wire`` on every hop (1-D float32, M values).
    ``plain``: run the torch reference instead of the compiled hops (the same bits)."""
    hops, x, numel, wired = _prepare(inputs, wire, algorithm, accumulate, plain)
    if algorithm == "tree":
        total = _tree(x.reshape(len(x), 1, -1).clone(), hops, wired)
    else:
        total = _scatter(x, hops, algorithm, wired)
    if not wired:  # the all-gather (broadcast) sends each result once in the wire format
        rows = total.shape[0]
        hops.hop(total, total[None], torch.zeros(rows, dtype=torch.int64), -1, ROUND)
    return total.reshape(-1)[:numel]


@dataclass(frozen=True)
class Collective:
    """A collective as it runs: ``wire`` format, ``algorithm`` and ``accumulate``
    (what a simulated communicator calls with the learners' parts of one message)."""

    wire: Format
    algorithm: str = "ring"
    accumulate: str = "fp32"

    @classmethod
    def named(cls, wire: str, algorithm: str = "ring", accumulate: str = "fp32") -> Collective:
        """The collective for a format name; a ``UsageError`` for unknown settings."""
        _check([torch.zeros(1)], algorithm, accumulate)
        return cls(wire_format(wire), algorithm, accumulate)

    def reduce(self, parts: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        """The sum every learner holds after an all-reduce of ``parts``."""
        return all_reduce(
            parts, wire=self.wire, algorithm=self.algorithm, accumulate=self.accumulate
        )

    def reduce_scatter(self, parts: Sequence[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
        """Each owner's chunk of the sum after a reduce-scatter of ``parts``."""
        return reduce_scatter(
            parts, wire=self.wire, algorithm=self.algorithm, accumulate=self.accumulate
        )


def relative_error(
    total: torch.Tensor, inputs: Sequence[torch.Tensor] | torch.Tensor, block: int = 1 << 20
) -> float:
    """``||total / N - mean||^2 / ||mean||^2`` against the exact (float64) mean of the N
    ``inputs``, in blocks of ``block`` values (0 when the mean is zero and so is the
    error; ``inf`` when only the mean is)."""
    learners = len(inputs)
    error = norm = 0.0
    for start in range(0, total.numel(), block):
        stop = start + block
        mean = sum(row.reshape(-1)[start:stop].double() for row in inputs) / learners
        error += float(((total[start:stop].double() / learners - mean) ** 2).sum())
        norm += float((mean**2).sum())
    if norm == 0.0:
        return 0.0 if error == 0.0 else float("inf")
    return error / norm
