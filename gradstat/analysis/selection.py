"""What an analysis looks at: one validated :class:`Selection` (steps, learners, scope),
and the parsing of ratios and links.

Shared by every analysis so that steps, learners, scope and ratios mean the same thing in
every command and in Python: each accepts the command line's text (``"::10"``, ``"0,2"``,
``"0.01,0.001"``) or Python values (``[0, 10]``, ``[0, 2]``, ``[0.01]``). Errors name the
parameter (``learners=[7]``), so they read the same from the command line and from Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from gradstat import defaults
from gradstat.compressors.cost import Link, parse_bandwidth, parse_latency
from gradstat.errors import UsageError
from gradstat.stats.density import k_for as k_for  # the one rule, re-exported here
from gradstat.store.picking import LearnersSpec, StepsSpec
from gradstat.store.picking import select_learners as select_learners
from gradstat.store.picking import select_steps as select_steps

if TYPE_CHECKING:
    from gradstat.store import Capture, Scope


def parse_ratios(spec: str | float | Sequence[float]) -> list[float]:
    """Target densities k/d, each strictly between 0 and 1: ``"0.01,0.001"``, ``0.01`` or
    a sequence."""
    if isinstance(spec, str):
        items = spec.split(",")
    elif isinstance(spec, int | float):
        items = [spec]
    else:
        items = list(spec)
    try:
        ratios = [float(item) for item in items]
    except (TypeError, ValueError):
        raise UsageError(f"ratios={spec!r}: expected numbers such as 0.01,0.001") from None
    for ratio in ratios:
        if not (0.0 < ratio < 1.0) or not np.isfinite(ratio):
            raise UsageError(f"ratio {ratio} is outside (0, 1)")
    if not ratios:
        raise UsageError("give at least one ratio")
    return ratios


def require_one_kept(scopes: Sequence[Scope], ratios: Sequence[float]) -> None:
    """Refuse a ratio that keeps no element of the largest of ``scopes`` (the one scope,
    usually): ``round(ratio * d) == 0``, which ``k_for`` would silently raise to k = 1.
    Smaller scopes of several (``layers``) keep k = 1 where the ratio keeps none."""
    if not scopes:
        return
    scope = max(scopes, key=lambda s: s.numel)
    for ratio in ratios:
        if round(ratio * scope.numel) < 1:
            raise UsageError(
                f"ratio {ratio:g} keeps less than one of the {scope.numel:,} elements of "
                f"scope {scope.name!r} (the smallest density there is {1 / scope.numel:.3g})"
            )


@dataclass(frozen=True)
class Selection:
    """The validated part of a capture an analysis looks at.

    ``steps`` and ``learners`` are recorded steps and ranks in the order given; ``scope``
    is ``"model"``, ``"layers"`` or a layer-name regex (``Capture.scopes``). Build one
    with :meth:`of`; it is small, so worker processes and other ranks receive it as it
    is.
    """

    steps: tuple[int, ...]
    learners: tuple[int, ...]
    scope: str = "model"

    @classmethod
    def of(
        cls,
        cap: Capture,
        steps: StepsSpec = None,
        learners: LearnersSpec = None,
        scope: str = "model",
    ) -> Selection:
        """Validate a selection of ``cap``: text as on the command line or Python values."""
        chosen_steps = select_steps(cap.steps, steps)
        chosen_learners = select_learners(cap.learners, learners)
        cap.scopes(scope)  # a scope that matches nothing is refused here
        return cls(tuple(chosen_steps), tuple(chosen_learners), scope)

    def scopes(self, cap: Capture) -> list[Scope]:
        """The scopes of ``cap`` this selection names."""
        return cap.scopes(self.scope)

    def require_learners(self, minimum: int, what: str) -> None:
        """Refuse a selection with fewer learners than ``what`` needs, saying why."""
        if len(self.learners) < minimum:
            raise UsageError(
                f"{what} compares learners' top-k sets and needs at least {minimum} "
                f"learners; the selection has {len(self.learners)}"
            )


LinkSpec = Link | str | tuple | None


def as_link(spec: LinkSpec) -> Link:
    """A :class:`Link` from a Link, the command line's text (``"10Gbit/s"``, or
    ``"10Gbit/s,5us"`` with a latency) or ``(bandwidth, latency)`` as text or numbers
    (bytes/s, seconds); None or an omitted latency: the commands' defaults
    (``--bandwidth 10Gbit/s --latency 5us``)."""
    if isinstance(spec, Link):
        return spec
    if spec is None:
        spec = (defaults.BANDWIDTH, defaults.LATENCY)
    elif isinstance(spec, str):
        parts = [part.strip() for part in spec.split(",")]
        if len(parts) > 2:
            raise UsageError(f"link={spec!r}: expected BANDWIDTH or BANDWIDTH,LATENCY")
        spec = (parts[0], parts[1] if len(parts) > 1 else defaults.LATENCY)
    try:
        bandwidth, latency = spec
    except (TypeError, ValueError):
        raise UsageError(
            f"link={spec!r}: expected a Link, '10Gbit/s[,5us]' or (bandwidth, latency)"
        ) from None
    return Link(
        parse_bandwidth(bandwidth) if isinstance(bandwidth, str) else float(bandwidth),
        parse_latency(latency) if isinstance(latency, str) else float(latency),
    )
