"""Top-k sets of one step, streamed one learner's row (or column block) at a time.

The top-k set analyses never stack a step's learners: each learner's row is read into
one reused buffer, moved to the compute device, added to a float64 running sum (the
mean gradient, exact to float32 rounding of the final division) and cut to its top-k
candidates. Memory is one row buffer, the float64 sum and O(learners x k) for the index
sets, whatever the number of learners.

When a row of the scope is longer than the memory budget allows
(``Compute.block_numel``), the scope is processed in column blocks: every learner's
block, then the next block. Top-k over blocks is exact: each block keeps its own top-k
candidates (any index of the global top-k is in its block's top-k), and a running top-k
of the merged candidates is carried from block to block. The mean's value at each
candidate is taken while its block's mean is at hand, so the energy E(I) of the final
sets needs no second pass (docs/methods.md 3).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gradstat.errors import DataError
from gradstat.stats.topk_sets import topk_indices
from gradstat.store import Capture, Scope

#: Elements per chunk when turning the float64 sum into the float32 mean and summing its
#: squares: bounds the temporaries to a few MiB.
CHUNK = 1 << 20


@dataclass
class _Running:
    """A running top-k: |values|, indices (scope-local) and the mean's value at each."""

    magnitudes: torch.Tensor
    indices: torch.Tensor
    mean_values: torch.Tensor | None = None

    def merge(self, other: _Running, k: int) -> _Running:
        magnitudes = torch.cat([self.magnitudes, other.magnitudes])
        if magnitudes.numel() <= k:
            keep = torch.arange(magnitudes.numel(), device=magnitudes.device)
        else:
            keep = torch.topk(magnitudes, k, sorted=False).indices
        mean_values = None
        if self.mean_values is not None and other.mean_values is not None:
            mean_values = torch.cat([self.mean_values, other.mean_values])[keep]
        return _Running(
            magnitudes[keep], torch.cat([self.indices, other.indices])[keep], mean_values
        )

    def top(self, k: int) -> _Running:
        """The top-k of these candidates (k at most their number)."""
        keep = torch.topk(self.magnitudes, k, sorted=False).indices
        mean_values = None if self.mean_values is None else self.mean_values[keep]
        return _Running(self.magnitudes[keep], self.indices[keep], mean_values)


@dataclass(frozen=True)
class StepSets:
    """Top-k sets of one step and scope at one k.

    ``indices``: ``[n + 1, k]`` (learners, then the mean gradient when it was computed,
    else ``[n, k]``); ``energy``: E(I) of the mean gradient for each row (float64, or None);
    ``sparse``: whether some learner's vector has fewer than k non-zeros (its set is then
    partly arbitrary ties).
    """

    k: int
    d: int
    indices: torch.Tensor
    energy: torch.Tensor | None
    sparse: bool


def column_blocks(numel: int, block: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of consecutive blocks of at most ``block`` columns."""
    for start in range(0, numel, block):
        yield start, min(numel, start + block)


def scope_pieces(scope: Scope, start: int, stop: int) -> Iterator[tuple[int, int, int]]:
    """Scope-local columns ``[start, stop)`` as ``(flat start, flat stop, local start)``."""
    local = 0
    for offset, numel in scope.slices:
        lo, hi = max(start, local), min(stop, local + numel)
        if lo < hi:
            yield offset + lo - local, offset + hi - local, lo
        local += numel


def read_block(
    cap: Capture, step: int, learner: int, scope: Scope, start: int, stop: int, out: np.ndarray
) -> np.ndarray:
    """The scope-local columns ``[start, stop)`` of one learner's row, into ``out``."""
    view = out[: stop - start]
    for flat_start, flat_stop, local in scope_pieces(scope, start, stop):
        piece = view[local - start : local - start + flat_stop - flat_start]
        cap.read_row(step, learner, out=piece, columns=slice(flat_start, flat_stop))
    return view


def _require_finite(step: int, learner: int, x: torch.Tensor) -> None:
    """A float64 sum of float32 values cannot overflow, so it is finite iff every value is."""
    if not math.isfinite(float(x.sum(dtype=torch.float64))):
        bad = int((~torch.isfinite(x)).sum())
        raise DataError(
            f"step {step}, learner {learner}: {bad} NaN/Inf gradient values; a top-k set "
            "analysis needs finite gradients (leave the step out with --steps; "
            "`gradstat fit` excludes such values)"
        )


def _block_candidates(x: torch.Tensor, k: int, start: int) -> _Running:
    idx = topk_indices(x, min(k, x.numel()))
    return _Running(x[idx].abs(), idx + start)


def stream_step_sets(
    cap: Capture,
    step: int,
    learners: Sequence[int],
    scope: Scope,
    ks: Sequence[int],
    *,
    with_mean: bool,
    device: torch.device,
    block: int,
) -> list[StepSets]:
    """Top-k sets of every learner (and of the mean when ``with_mean``) for each k in ``ks``.

    Reads each learner's row once (in column blocks of ``block`` when shorter than the
    scope); exact, module docstring.
    """
    d, n, kmax = scope.numel, len(learners), max(ks)
    block = min(block, d)
    buffer = np.empty(block, dtype=np.float32)
    running: list[_Running | None] = [None] * (n + 1)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for start, stop in column_blocks(d, block):
        width = stop - start
        total_sum = torch.zeros(width, dtype=torch.float64, device=device) if with_mean else None
        candidates = []
        for learner in learners:
            x = torch.from_numpy(read_block(cap, step, learner, scope, start, stop, buffer))
            x = x.to(device)
            _require_finite(step, learner, x)
            if total_sum is not None:
                total_sum.add_(x)
            candidates.append(_block_candidates(x, kmax, start))
        if total_sum is not None:
            mean = _mean(total_sum, n, buffer, device)
            del total_sum
            for chunk in mean.split(CHUNK):
                total += torch.linalg.vector_norm(chunk, dtype=torch.float64).square()
            candidates.append(_block_candidates(mean, kmax, start))
            for c in candidates:
                c.mean_values = mean[c.indices - start].double()
        for i, c in enumerate(candidates):
            running[i] = c if running[i] is None else running[i].merge(c, kmax)
    rows = running[: n + 1 if with_mean else n]
    out = []
    for k in ks:
        tops = [r.top(k) for r in rows]
        indices = torch.stack([t.indices for t in tops])
        sparse = bool(torch.stack([t.magnitudes.min() for t in tops[:n]]).eq(0).any())
        energy = None
        if with_mean:
            energy = torch.stack([t.mean_values.square().sum() for t in tops]) / total
        out.append(StepSets(k, d, indices, energy, sparse))
    return out


def _mean(
    total_sum: torch.Tensor, n: int, buffer: np.ndarray, device: torch.device
) -> torch.Tensor:
    """float32(sum / n), chunk by chunk; on the CPU into the (now free) row buffer."""
    width = total_sum.numel()
    if device.type == "cpu":
        mean = torch.from_numpy(buffer[:width])
    else:
        mean = torch.empty(width, dtype=torch.float32, device=device)
    for target, source in zip(mean.split(CHUNK), total_sum.split(CHUNK), strict=True):
        target.copy_(source / n)
    return mean
