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
learner holds the same values. Each hop processes all chunks at once as one tensor
operation; ``tests/test_collectives.py`` holds the plain message-by-message loops that
the results equal bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gradstat.compressors.formats import Format, wire_format
from gradstat.errors import UsageError

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


def _ring(x: torch.Tensor, fmt: Format, wire: bool) -> torch.Tensor:
    """Ring reduce-scatter of ``x`` (N learners, N chunks, C): (N chunks, C), chunk ``c``
    as its owner holds it."""
    n = x.shape[0]
    chunks = torch.arange(n)
    acc = x[(chunks + 1) % n, chunks]  # chunk c starts at learner c + 1
    if wire:
        acc = fmt.round(acc)
    for hop in range(1, n):
        mine = x[(chunks + 1 + hop) % n, chunks]  # the receiver's own chunk c
        acc = fmt.round(acc + fmt.round(mine)) if wire else fmt.round(acc).add_(mine)
    return acc


def _tree(v: torch.Tensor, fmt: Format, wire: bool) -> torch.Tensor:
    """Binomial-tree reduction of ``v`` (N learners counted from the root, chunks, C;
    summed into in place) to learner 0: (chunks, C)."""
    n = v.shape[0]
    if wire:
        v = fmt.round(v)
    step = 1
    while step < n:
        receivers = v[0 : n : 2 * step]
        senders = v[step : n : 2 * step]
        k = senders.shape[0]
        if wire:
            receivers[:k] = fmt.round(receivers[:k] + senders)
        else:
            receivers[:k] += fmt.round(senders)
        step *= 2
    return v[0]


def _a2a(x: torch.Tensor, fmt: Format, wire: bool) -> torch.Tensor:
    """All-to-all then the owners' sums in rank order: (N chunks, C)."""
    n = x.shape[0]
    acc = None
    for learner in range(n):
        sent = fmt.round(x[learner])  # learner's chunk c, sent to learner c
        if not wire:  # its own chunk never leaves it
            sent[learner] = x[learner, learner]
        if acc is None:
            acc = sent
        elif wire:
            acc = fmt.round(acc + sent)
        else:
            acc += sent
    return acc


def _scatter(x: torch.Tensor, fmt: Format, algorithm: str, wire: bool) -> torch.Tensor:
    """Each owner's chunk of the sum: (N, C), from ``x`` (N learners, N chunks, C)."""
    n = x.shape[0]
    if algorithm == "ring":
        return _ring(x, fmt, wire)
    if algorithm == "a2a":
        return _a2a(x, fmt, wire)
    chunks = torch.arange(n)
    learners = (torch.arange(n)[:, None] + chunks[None, :]) % n  # counted from each owner
    return _tree(x[learners, chunks[None, :]], fmt, wire)


def reduce_scatter(
    inputs: Sequence[torch.Tensor] | torch.Tensor,
    *,
    wire: str | Format = "fp32",
    algorithm: str = "ring",
    accumulate: str = "fp32",
) -> list[torch.Tensor]:
    """Each learner's chunk of the element-wise sum of ``inputs`` (N learners' 1-D
    float32 tensors of equal length, or an (N, M) tensor), as its owner holds it after a
    reduce-scatter by ``algorithm`` with ``wire`` on every hop: N float32 tensors,
    chunk ``c`` = values ``c * C .. (c + 1) * C`` of the sum (the last ones shorter)."""
    learners = _check(inputs, algorithm, accumulate)
    fmt = wire_format(wire)
    numel = inputs[0].numel()
    x = _stack(inputs, learners)
    owned = _scatter(x.view(learners, learners, -1), fmt, algorithm, accumulate == "wire")
    chunk = owned.shape[1]
    return [owned[c, : max(0, min(chunk, numel - c * chunk))] for c in range(learners)]


def all_reduce(
    inputs: Sequence[torch.Tensor] | torch.Tensor,
    *,
    wire: str | Format = "fp32",
    algorithm: str = "ring",
    accumulate: str = "fp32",
) -> torch.Tensor:
    """The element-wise sum of ``inputs`` that every learner holds after an all-reduce by
    ``algorithm`` (``ring`` and ``a2a``: reduce-scatter + all-gather; ``tree``: reduce to
    learner 0 + broadcast) with ``wire`` on every hop (1-D float32, M values)."""
    learners = _check(inputs, algorithm, accumulate)
    fmt = wire_format(wire)
    wired = accumulate == "wire"
    numel = inputs[0].numel()
    x = _stack(inputs, learners)
    if algorithm == "tree":
        total = _tree(x.view(learners, 1, -1).clone(), fmt, wired)
    else:
        total = _scatter(x.view(learners, learners, -1), fmt, algorithm, wired)
    if not wired:  # the all-gather (broadcast) sends each result once in the wire format
        total = fmt.round(total)
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
