"""Refusing non-finite gradients where an analysis cannot give them a meaning.

Top-k sets, error-feedback memories and compressor replays turn one NaN or Inf into
nonsense for every later step, so these analyses stop with the step and learner at
fault. (``gradstat fit`` instead excludes, counts and warns, since a fit of the finite
values is still meaningful.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gradstat.errors import DataError


def require_finite(
    step: int,
    grads: torch.Tensor,
    learners: Sequence[int],
    what: str,
    known_finite: bool | torch.Tensor = False,
) -> None:
    """Raise ``DataError`` naming the first of ``learners`` whose row of ``grads`` (one
    row per learner, or a single row) holds NaN/Inf, with the exact count.
    ``known_finite``: a quick answer that is True only when every value is finite (the
    row scan's flag), which skips the count."""
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
