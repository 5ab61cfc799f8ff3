"""Which recorded steps and learners a read covers: the command line's text (``"::10"``,
``"0,2"``) or Python values (``[0, 10]``, ``[0, 2]``), checked against the capture.

The one parser of steps and learners, below the analyses so that the store's own
iterators (:meth:`Capture.iter_steps`) take the same specs as every command;
:mod:`gradstat.analysis.selection` re-exports it. Errors name the parameter
(``learners=[7]``), so they read the same from the command line and from Python.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gradstat.errors import UsageError
from gradstat.store.ranks import format_ranks

StepsSpec = str | int | Sequence[int] | None
LearnersSpec = str | int | Sequence[int] | None


def select_steps(recorded: Sequence[int], spec: StepsSpec) -> list[int]:
    """Recorded training steps chosen by ``spec``.

    ``None`` or ``""``: all; ``"7"`` or ``7``: step 7; ``"START:STOP[:EVERY]"``: the
    recorded steps s with START <= s < STOP (either end may be empty), then every EVERY-th
    of them; ``"3,9,12"`` or ``[3, 9, 12]``: those steps. Asking for a step that was not
    recorded is an error.
    """
    recorded = [int(s) for s in recorded]
    if not recorded:
        raise UsageError("the capture has no committed steps")
    if spec is None or (isinstance(spec, str) and not spec.strip()):
        return recorded
    if not isinstance(spec, str):
        wanted = _integers(spec, "steps")
        if not wanted:
            raise UsageError("steps=[] selects no step")
        return _recorded(wanted, recorded)
    try:
        if ":" in spec:
            parts = spec.split(":")
            if len(parts) > 3:
                raise ValueError
            start = int(parts[0]) if parts[0] else recorded[0]
            stop = int(parts[1]) if len(parts) > 1 and parts[1] else recorded[-1] + 1
            every = int(parts[2]) if len(parts) > 2 and parts[2] else 1
            if every <= 0:
                raise UsageError(f"steps={spec!r}: the step must be positive")
            if stop <= start:
                raise UsageError(f"steps={spec!r}: STOP {stop} must be greater than START {start}")
            chosen = [s for s in recorded if start <= s < stop][::every]
            if not chosen:
                raise UsageError(
                    f"steps={spec!r} selects no recorded step "
                    f"(recorded: {recorded[0]}..{recorded[-1]})"
                )
            return chosen
        wanted = [int(part) for part in spec.split(",")]
    except UsageError:  # a ValueError too: not to be replaced by the generic message
        raise
    except ValueError:
        raise UsageError(f"steps={spec!r}: expected N, A,B,C or START:STOP[:STEP]") from None
    return _recorded(wanted, recorded)


def _integers(spec: int | Sequence[int], name: str) -> list[int]:
    """An int or a sequence of ints as a list (bools and floats refused)."""
    items = [spec] if isinstance(spec, int | np.integer) else spec
    try:
        values = list(items)
    except TypeError:
        raise UsageError(f"{name}={spec!r}: expected integers") from None
    if not all(isinstance(v, int | np.integer) and not isinstance(v, bool) for v in values):
        raise UsageError(f"{name}={spec!r}: expected integers")
    return [int(v) for v in values]


def _recorded(wanted: list[int], recorded: list[int]) -> list[int]:
    missing = sorted(set(wanted) - set(recorded))
    if missing:
        raise UsageError(
            f"step {missing[0]} was not recorded (recorded: {recorded[0]}..{recorded[-1]}, "
            f"{len(recorded)} steps)"
        )
    if len(set(wanted)) != len(wanted):
        raise UsageError(f"steps={wanted!r} names a step twice")
    return wanted


def select_learners(recorded: Sequence[int], spec: LearnersSpec, minimum: int = 1) -> list[int]:
    """Learners chosen by ``"0,2"`` or ``[0, 2]`` (default all recorded), at least
    ``minimum`` of them.

    Learners are named by their rank in the run; ``recorded`` are those with a rank file
    (all ranks unless the capture used ``--record-ranks``).
    """
    recorded = [int(r) for r in recorded]
    if spec is None or (isinstance(spec, str) and not spec.strip()):
        chosen = recorded
    else:
        if isinstance(spec, str):
            try:
                chosen = [int(part) for part in spec.split(",")]
            except ValueError:
                raise UsageError(f"learners={spec!r}: expected comma-separated ranks") from None
        else:
            chosen = _integers(spec, "learners")
        if not chosen:
            raise UsageError("learners=[] selects no learner")
        bad = [r for r in chosen if r not in recorded]
        if bad:
            raise UsageError(
                f"learner {bad[0]} is not in the capture (recorded: {format_ranks(recorded)})"
            )
        if len(set(chosen)) != len(chosen):
            raise UsageError(f"learners={spec!r} names a learner twice")
    if len(chosen) < minimum:
        raise UsageError(
            f"this analysis needs at least {minimum} learners; the selection has {len(chosen)}"
        )
    return chosen
