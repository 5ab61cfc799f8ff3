"""Parsing and validating what an analysis looks at: steps, learners and ratios.

Shared by every analysis so that ``--steps``, ``--learners`` and ``--ratios`` mean the
same thing in every command.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gradstat.errors import UsageError
from gradstat.store.ranks import format_ranks


def select_steps(recorded: Sequence[int], spec: str | None) -> list[int]:
    """Recorded training steps chosen by ``spec``.

    ``None`` or ``""``: all; ``"7"``: step 7; ``"START:STOP[:EVERY]"``: the recorded steps
    s with START <= s < STOP (either end may be empty), then every EVERY-th of them;
    ``"3,9,12"``: those steps. Asking for a step that was not recorded is an error.
    """
    recorded = [int(s) for s in recorded]
    if not recorded:
        raise UsageError("the capture has no committed steps")
    if not spec:
        return recorded
    try:
        if ":" in spec:
            parts = spec.split(":")
            if len(parts) > 3:
                raise ValueError
            start = int(parts[0]) if parts[0] else recorded[0]
            stop = int(parts[1]) if len(parts) > 1 and parts[1] else recorded[-1] + 1
            every = int(parts[2]) if len(parts) > 2 and parts[2] else 1
            if every <= 0:
                raise UsageError(f"--steps {spec!r}: the step must be positive")
            chosen = [s for s in recorded if start <= s < stop][::every]
            if not chosen:
                raise UsageError(
                    f"--steps {spec!r} selects no recorded step "
                    f"(recorded: {recorded[0]}..{recorded[-1]})"
                )
            return chosen
        wanted = [int(part) for part in spec.split(",")]
    except ValueError:
        raise UsageError(f"--steps {spec!r}: expected N, A,B,C or START:STOP[:STEP]") from None
    missing = sorted(set(wanted) - set(recorded))
    if missing:
        raise UsageError(
            f"step {missing[0]} was not recorded (recorded: {recorded[0]}..{recorded[-1]}, "
            f"{len(recorded)} steps)"
        )
    return wanted


def select_learners(recorded: Sequence[int], spec: str | None, minimum: int = 1) -> list[int]:
    """Learners chosen by ``"0,2"`` (default all recorded), at least ``minimum`` of them.

    Learners are named by their rank in the run; ``recorded`` are those with a rank file
    (all ranks unless the capture used ``--record-ranks``).
    """
    recorded = [int(r) for r in recorded]
    if not spec:
        chosen = recorded
    else:
        try:
            chosen = [int(part) for part in spec.split(",")]
        except ValueError:
            raise UsageError(f"--learners {spec!r}: expected comma-separated ranks") from None
        bad = [r for r in chosen if r not in recorded]
        if bad:
            raise UsageError(
                f"learner {bad[0]} is not in the capture (recorded: {format_ranks(recorded)})"
            )
        if len(set(chosen)) != len(chosen):
            raise UsageError(f"--learners {spec!r} names a learner twice")
    if len(chosen) < minimum:
        raise UsageError(
            f"this analysis needs at least {minimum} learners; the selection has {len(chosen)}"
        )
    return chosen


def parse_ratios(spec: str | Sequence[float]) -> list[float]:
    """Target densities k/d, each strictly between 0 and 1."""
    try:
        ratios = [float(part) for part in spec.split(",")] if isinstance(spec, str) else list(spec)
    except ValueError:
        raise UsageError(f"ratios {spec!r}: expected numbers such as 0.01,0.001") from None
    for ratio in ratios:
        if not (0.0 < ratio < 1.0) or not np.isfinite(ratio):
            raise UsageError(f"ratio {ratio} is outside (0, 1)")
    if not ratios:
        raise UsageError("give at least one ratio")
    return ratios


def k_for(ratio: float, numel: int) -> int:
    """Number of elements a density keeps: ``max(1, round(ratio * numel))``."""
    return max(1, round(ratio * numel))
