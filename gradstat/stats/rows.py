"""The row toolkit: what an analysis does to each float32 row (or column block of one)
it reads, on any device, each in one place.

* **Finite or not**: :func:`require_finite` stops an analysis at the first learner
  whose row holds NaN/Inf, naming step, learner and count; a scan's flag is its quick
  answer (:func:`scan`), :func:`count_nonfinite` the count where NaN/Inf are excluded
  instead (``fit``).
* **The step's mean**: :class:`CompensatedSum`, a float32 sum with Kahan's compensation
  (:func:`~gradstat.stats.row_plain.compensated_add`), whose error stays about 2 eps
  sum |x_i| whatever the number of rows, as a float64 sum's would.
* **One scan**: :func:`scan` checks a row, adds it to the sum and finds its top-k
  candidates in one pass (on the CPU the fused loop of
  :func:`~gradstat.stats.row_kernels.scan_row`, elsewhere torch's ops), and
  :func:`scan_mean` makes the mean with its candidates and sum of squares.
* **Top-k**: :func:`~gradstat.stats.topk_sets.top_of` selects from the candidates.

Reading the rows is the analyses' (:mod:`gradstat.analysis.row_workspace`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from gradstat.errors import DataError
from gradstat.stats import row_kernels
from gradstat.stats.row_kernels import Room
from gradstat.stats.row_plain import compensated_add
from gradstat.stats.topk_sets import indices_above


def count_nonfinite(x: torch.Tensor) -> int:
    """How many values of ``x`` are NaN or Inf: none when their sum is finite (a cheap
    pass; gradients rarely hold any), else counted."""
    if bool(torch.isfinite(x.sum())):
        return 0
    return x.numel() - int(torch.count_nonzero(torch.isfinite(x)))


def require_finite(
    step: int,
    grads: torch.Tensor,
    learners: Sequence[int],
    what: str,
    known_finite: bool | torch.Tensor = False,
) -> None:
    """Raise ``DataError`` naming the first of ``learners`` whose row of ``grads`` (one
    row per learner, or a single row) holds NaN/Inf, with the exact count. Top-k sets,
    error-feedback memories and compressor replays turn one NaN or Inf into nonsense for
    every later step (``fit`` instead excludes, counts and warns). ``known_finite``: a
    quick answer that is True only when every value is finite (a scan's flag), which
    skips the count."""
    if bool(known_finite):
        return
    bad = (~torch.isfinite(grads.reshape(len(learners), -1))).sum(dim=-1)
    if bool(bad.any()):
        row = int(torch.nonzero(bad)[0])
        raise DataError(
            f"step {step}, learner {learners[row]}: {int(bad[row])} NaN/Inf gradient values; "
            f"{what} needs finite gradients (leave the step out with --steps; "
            "`gradstat fit` excludes such values)"
        )


class CompensatedSum:
    """A running sum of float32 rows of ``width`` values in float32 with Kahan's
    compensation: the sum is ``total - error``. A step's first row makes it (copied in,
    not added to zeros); kept for the steps of a unit."""

    def __init__(self, width: int, device: torch.device) -> None:
        self.total = torch.empty(width, dtype=torch.float32, device=device)
        self.error = torch.empty(width, dtype=torch.float32, device=device)

    def parts(self, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The sum's first ``d`` columns: (total, error)."""
        return self.total[:d], self.error[:d]

    def add(self, x: torch.Tensor, first: bool) -> None:
        """Add ``x`` to the first ``len(x)`` columns (``first``: the sum becomes ``x``)."""
        s, c = self.parts(x.numel())
        if first:
            s.copy_(x)
            c.zero_()
        else:
            t, compensation = compensated_add(s, c, x)
            s.copy_(t)
            c.copy_(compensation)

    def mean(self, n: int, *, out: torch.Tensor) -> torch.Tensor:
        """The mean of ``n`` rows, ``(total - error) / n``, of the first ``len(out)``
        columns into ``out`` (float32, as the compiled loops make it)."""
        total, error = self.parts(out.numel())
        return torch.sub(total, error, out=out).div_(n)


class Found(NamedTuple):
    """A scan's candidates (indices ascending, int64, and |x| at each: valid until the
    room they are in is reused) and whether the row was finite."""

    indices: torch.Tensor
    magnitudes: torch.Tensor
    finite: bool


def scan(
    x: torch.Tensor,
    threshold: float | None,
    room: Room,
    sums: CompensatedSum | None = None,
    first: bool = False,
) -> Found:
    """One pass over the flat float32 row ``x``: its candidates ``|x| >= threshold``
    (none for None), whether it is finite, and with ``sums`` the row added to them
    (``first``: the step's first row makes them). On the CPU the fused loop
    (:func:`~gradstat.stats.row_kernels.scan_row`; ``room`` for its candidates), on
    other devices torch's ops."""
    d = x.numel()
    if x.device.type == "cpu":
        total, error = (None, None) if sums is None else sums.parts(d)
        found = row_kernels.scan_row(
            x.numpy(),
            threshold,
            room,
            total=None if total is None else total.numpy(),
            error=None if error is None else error.numpy(),
            first=first,
        )
        indices, magnitudes = torch.from_numpy(found.indices), torch.from_numpy(found.magnitudes)
        return Found(indices, magnitudes, found.finite)
    finite = bool(torch.isfinite(x).all())
    if sums is not None:
        sums.add(x, first)
    if threshold is None:
        indices = torch.empty(0, dtype=torch.int64, device=x.device)
    else:
        indices = indices_above(x, threshold)
    return Found(indices, x.index_select(0, indices).abs(), finite)


def scan_mean(
    sums: CompensatedSum, n: int, mean: torch.Tensor, threshold: float | None, room: Room
) -> tuple[Found, float]:
    """The mean of the ``n`` rows added to ``sums``, ``(total - error) / n`` in float32,
    into ``mean`` (as long as the rows), with its candidates (as :func:`scan`) and its
    float64 sum of squares, in one pass on the CPU
    (:func:`~gradstat.stats.row_kernels.mean_row`)."""
    total, error = sums.parts(mean.numel())
    if mean.device.type == "cpu":
        indices, magnitudes, squares = row_kernels.mean_row(
            total.numpy(), error.numpy(), n, mean.numpy(), threshold, room
        )
        found = Found(torch.from_numpy(indices), torch.from_numpy(magnitudes), True)
        return found, squares
    sums.mean(n, out=mean)
    squares = float(torch.sum(mean.double().square()))
    return scan(mean, threshold, room), squares
