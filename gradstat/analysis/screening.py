"""The screen of ``recommend``: every candidate on a column sample first, then only
those that can still win on the whole model (docs/replay.md, "The screen", gives the
sample, the prediction at full size, the rule and its limits).

The sample: :func:`sample_for`, its plan's compressed values ``f`` times fewer than the
whole plan's; the replay on it and each candidate's predicted time: :func:`screen`; the
rule (margins :data:`ERROR_MARGIN` and :data:`TIME_MARGIN`): :func:`decide`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd
import torch

from gradstat.analysis.ef_store import scratch_folder
from gradstat.analysis.pricing import measure_price
from gradstat.analysis.replay import Replay
from gradstat.analysis.replay_records import COLUMNS, summarize_replay
from gradstat.analysis.replay_stream import memory_bytes_needed
from gradstat.analysis.row_workspace import read_block
from gradstat.compressors.cost import Link
from gradstat.compressors.plan import Plan, regrouped
from gradstat.compressors.registry import Scheme, build_scheme
from gradstat.errors import GradstatError
from gradstat.formatting import counted
from gradstat.parallel.progress import Progress, no_progress
from gradstat.sizes import format_bytes
from gradstat.store import Scope
from gradstat.threads import torch_threads

__all__ = [
    "SCREEN_VALUES",
    "Dropped",
    "Screen",
    "announce",
    "kept_text",
    "sample_for",
    "sample_plan",
    "screen",
]

#: Values per learner and step the screen replays (the sample's size).
SCREEN_VALUES = 1 << 18
#: Least values of each compressed message in the sample.
MIN_MESSAGE = 1 << 15
#: The screen runs only when the plan is at least this many times the sample.
MIN_FRACTION = 4.0
#: Timed rounds of each candidate's price on the sample.
SCREEN_ROUNDS = 5
#: Dropped: error on the sample over this times the budget ...
ERROR_MARGIN = 1.5
#: ... or predicted more than this times slower than the fastest clearly within it.
TIME_MARGIN = 2.0


@dataclass(frozen=True)
class Sample:
    """The screen's columns: ``scope`` (the sampled columns of the replayed scope),
    ``plan`` (the plan's messages cut down to them) and ``fraction``, the plan's
    compressed values over the sample's."""

    scope: Scope
    plan: Plan
    fraction: float

    def local_plan(self) -> Plan:
        """:attr:`plan` with its slices at their places in the sample's own row (the
        columns of :attr:`scope` end to end), as a price is measured on that row."""
        local, position = {}, 0
        for offset, numel in self.scope.slices:
            local[offset] = position
            position += numel
        messages = [
            replace(m, slices=tuple((local[o], k) for o, k in m.slices)) for m in self.plan.messages
        ]
        return regrouped(self.plan, messages)


def _rows(shape: tuple[int, ...], numel: int, every: float) -> tuple[tuple[int, ...], int]:
    """A parameter's leading ``ceil(rows / every)`` rows: (shape, values)."""
    if not shape or numel == 0:
        return shape, numel
    rows = max(1, math.ceil(shape[0] / every))
    return (rows, *shape[1:]), numel // shape[0] * rows


def sample_plan(scope: Scope, plan: Plan, every: float) -> Sample:
    """The column sample of ``plan`` (a plan of ``scope``) keeping one row in ``every``
    of each parameter, its leading rows."""
    messages, pieces = [], []
    for message in plan.messages:
        slices, shapes = [], []
        for (offset, numel), shape in zip(message.slices, message.shapes, strict=True):
            cut, kept = _rows(shape, numel, every)
            slices.append((offset, kept))
            shapes.append(cut)
        total = sum(kept for _, kept in slices)
        whole = len(message.shapes) == 1 and message.shape == message.shapes[0]
        shape = shapes[0] if whole else (total,)
        messages.append(replace(message, slices=tuple(slices), shapes=tuple(shapes), shape=shape))
        pieces += slices
    sampled = regrouped(plan, messages)
    inside = sum(m.numel for m in sampled.messages if not m.dense)
    full = sum(m.numel for m in plan.messages if not m.dense)
    return Sample(Scope(scope.name, tuple(sorted(pieces))), sampled, full / max(inside, 1))


def sample_for(scope: Scope, plan: Plan, values: int) -> Sample | None:
    """The sample of about ``values`` values (at least :data:`MIN_MESSAGE`, or
    ``values`` if fewer, per compressed message), or None where the plan is under
    :data:`MIN_FRACTION` times it."""
    values = max(values, min(values, MIN_MESSAGE) * len(plan.compressed))
    if values <= 0 or plan.numel < MIN_FRACTION * values:
        return None
    return sample_plan(scope, plan, plan.numel / values)


@dataclass(frozen=True)
class Dropped:
    """Candidates left out by the screen for one ``reason`` (``over budget``,
    ``slower`` or ``dominated``): their ``names``, and the sentence that says why."""

    reason: str
    names: tuple[str, ...]
    why: str

    def to_dict(self) -> dict:
        return {"reason": self.reason, "candidates": list(self.names), "why": self.why}


@dataclass(frozen=True)
class Screen:
    """The outcome: ``survivors`` (indices into the replay's schemes), the ``dropped``
    groups, the sample's ``values`` and ``fraction``, and ``estimates``, one row per
    scheme: its ``name``, error on the sample and predicted ``seconds`` at full size
    (NaN for one far over budget)."""

    survivors: tuple[int, ...]
    dropped: tuple[Dropped, ...]
    values: int
    fraction: float
    estimates: pd.DataFrame
    #: Compression seconds at full size measured on the sample, by scheme index
    #: (:class:`SamplePrices`; none for another target).
    prices: dict[int, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "sample_values": self.values,
            "fraction": self.fraction,
            "error_margin": ERROR_MARGIN,
            "time_margin": TIME_MARGIN,
            "kept": len(self.survivors),
            "dropped": [group.to_dict() for group in self.dropped],
        }


def label(scheme: Scheme) -> str:
    """A candidate as the screen names it: ``topk@0.01``, ``fp16``."""
    ratio = scheme.ratio
    return scheme.spec.label if ratio is None else f"{scheme.spec.label}@{ratio:g}"


def _sampled(run: Replay, sample: Sample) -> dict[int, Scheme]:
    """Each scheme of ``run`` on the sample's plan, by index; one that cannot run there
    (PowerSGD without a large enough matrix) is left out (it goes on unscreened)."""
    sampled = {}
    for i, (_, s) in enumerate(run.schemes):
        with contextlib.suppress(GradstatError):
            sampled[i] = build_scheme(s.spec, s.ratio, sample.plan, seed=s.seed)
    return sampled


def screen(
    run: Replay,
    sample: Sample,
    error_budget: float,
    *,
    compress: Callable[[int], float | None] | None = None,
    progress: Progress = no_progress,
) -> Screen:
    """Replay every scheme of ``run`` on ``sample`` over its steps and learners (memories
    in RAM within its compute's budget, else a scratch file) and decide which go on.
    ``compress``: the compression seconds of scheme ``i`` at full size where they are
    not measured here (another target's work model, a number format's casts); None (or
    None for a scheme): ``f`` times its price on the sample."""
    link = Link(run.link.bandwidth / sample.fraction, run.link.latency)
    sampled = _sampled(run, sample)
    failed: dict[int, BaseException] = dict.fromkeys(set(range(len(run.schemes))) - set(sampled))
    chosen = {i: (sample.scope, scheme) for i, scheme in sampled.items()}
    stream = run.stream_records(chosen, link, failed)
    with contextlib.closing(stream):
        steps = zip(progress(range(len(run.steps))), stream, strict=True)
        records = [record for _, found in steps for record in found]
    prices = SamplePrices(run, sample)

    def seconds(i: int) -> float:
        given = None if compress is None else compress(i)
        return prices.seconds(i) if given is None else given

    screened = decide(
        [label(s) for _, s in run.schemes],
        pd.DataFrame.from_records(records, columns=[*COLUMNS, "scheme"]),
        set(failed),
        error_budget,
        sample,
        link,
        run.cost_learners,
        seconds,
    )
    return replace(screened, prices=dict(prices.measured))


class SamplePrices:
    """One learner's compression seconds per step of ``run``'s schemes at full size:
    ``f`` times the price on the sample at the cluster size, measured as recommend
    prices (thread CPU time, the median of :data:`SCREEN_ROUNDS` rounds;
    :mod:`gradstat.analysis.pricing`) on learner 0's sampled row of the first step, on
    demand (the screen prices only the candidates not already far over budget)."""

    def __init__(self, run: Replay, sample: Sample) -> None:
        self.run, self.sample = run, sample
        self.row: torch.Tensor | None = None
        self.plan = sample.local_plan()
        self.measured: dict[int, float] = {}

    def seconds(self, i: int) -> float:
        """Scheme ``i``'s seconds; NaN where its code fails on the sample."""
        run, n = self.run, len(self.run.learners)
        if self.row is None:
            row = np.empty(self.sample.scope.numel, dtype=np.float32)
            step, learner = run.steps[0], run.learners[0]
            read_block(run.capture, step, learner, self.sample.scope, 0, row.size, row)
            self.row = torch.from_numpy(row)
        _, full = run.schemes[i]
        try:
            scheme = build_scheme(full.spec, full.ratio, self.plan, seed=full.seed)
            with torch_threads(run.params.threads):
                price = measure_price(
                    scheme, self.row, n, extrapolate=run.cost_learners != n, rounds=SCREEN_ROUNDS
                )
        except (GradstatError, RuntimeError, ValueError):
            return math.nan
        self.measured[i] = self.sample.fraction * price.at(run.cost_learners)
        return self.measured[i]


def decide(
    names: Sequence[str],
    records: pd.DataFrame,
    failed: set[int],
    error_budget: float,
    sample: Sample,
    link: Link,
    cost_learners: int,
    compress: Callable[[int], float],
) -> Screen:
    """Which schemes (``names``, in order) go on, from their ``records`` (key ``scheme``)
    on ``sample`` replayed with ``link`` and ``compress(i)``, scheme ``i``'s compression
    seconds at full size: a candidate goes on unless its error is over
    :data:`ERROR_MARGIN` times the budget, it is over :data:`TIME_MARGIN` times slower
    than the fastest within ``error_budget / ERROR_MARGIN``, or one of those that go on
    and within that bound is no slower with under ``1 / ERROR_MARGIN`` of its error
    (it could not win: recommend breaks a tie in time by error); those in ``failed``
    go on."""
    rows = []
    for i, name in enumerate(names):
        mine = records[records["scheme"] == i]
        if i in failed or mine.empty:
            rows.append({"name": name, "rel_error": math.nan, "seconds": math.nan})
            continue
        summary = summarize_replay(mine.drop(columns="scheme"), link, cost_learners).iloc[0]
        error = summary["rel_error"]
        seconds = math.nan  # not needed (nor measured) for one far over budget
        if not error > ERROR_MARGIN * error_budget:
            seconds = summary["comm_seconds"] + compress(i)
        rows.append({"name": name, "rel_error": error, "seconds": seconds})
    estimates = pd.DataFrame(rows, columns=["name", "rel_error", "seconds"])
    error, seconds = estimates["rel_error"], estimates["seconds"]
    far = error > ERROR_MARGIN * error_budget
    clear = error <= error_budget / ERROR_MARGIN
    best = seconds[clear].min() if clear.any() else math.inf
    slow = ~far & (seconds > TIME_MARGIN * best)
    # dominated: another candidate within the budget on the sample is no slower and has
    # under 1 / ERROR_MARGIN of the error (bf16 beside fp16: the same bytes, more error)
    kept = ~(far | slow)
    betters = [
        estimates["name"][kept & clear & (seconds <= seconds.iloc[i]) & (error * ERROR_MARGIN < e)]
        for i, e in enumerate(error)
    ]
    dominated = kept & pd.Series([len(b) > 0 for b in betters], index=estimates.index)
    survivors = tuple(i for i in range(len(names)) if kept.iloc[i] and not dominated.iloc[i])
    if not survivors:  # every one far over budget: the closest goes on, to be named
        closest = int(error.fillna(math.inf).to_numpy().argmin())
        survivors = (closest,)
        far.iloc[closest] = False
    dropped = []
    if far.any():
        dropped.append(
            Dropped(
                "over budget",
                tuple(estimates["name"][far]),
                f"mean relative error on the sample over {ERROR_MARGIN:g} x the budget "
                f"{error_budget:g}",
            )
        )
    if slow.any():
        fastest = estimates["name"][clear & (seconds == best)].iloc[0]
        dropped.append(
            Dropped(
                "slower",
                tuple(estimates["name"][slow]),
                f"predicted over {TIME_MARGIN:g} x the time of {fastest} ({best * 1e3:.3g} ms "
                f"per step), which is within the budget on the sample",
            )
        )
    if dominated.any():
        by = [
            f"{estimates['name'].iloc[i]} by {betters[i].iloc[0]}"
            for i in np.flatnonzero(dominated)
        ]
        dropped.append(
            Dropped(
                "dominated",
                tuple(estimates["name"][dominated]),
                f"predicted no faster than a candidate within the budget on the sample, with "
                f"over {ERROR_MARGIN:g} x its error there ({', '.join(by)})",
            )
        )
    return Screen(survivors, tuple(dropped), sample.plan.numel, sample.fraction, estimates)


def announce(run: Replay, sample: Sample | None) -> str:
    """The line said before the work: candidates, steps, the sample, and the memory and
    scratch the error-feedback memories take (docs/large.md)."""
    n, budget = len(run.learners), run.compute.memory_bytes()
    every = memory_bytes_needed([s for _, s in run.schemes], n)
    head = (
        f"recommend: {counted(len(run.schemes), 'candidate')} over "
        f"{counted(len(run.steps), 'step')} x {counted(n, 'learner')} of "
        f"{run.plan.numel:,} values"
    )
    where = (
        f"in RAM within --memory {format_bytes(budget)}, else in a scratch file in "
        f"{scratch_folder()}"
    )
    if sample is None:
        place = "in RAM" if every <= budget else f"in a scratch file in {scratch_folder()}"
        return f"{head}; error-feedback memories {format_bytes(every)}, {place}."
    screened = memory_bytes_needed(list(_sampled(run, sample).values()), n)
    return (
        f"{head}; screen on {sample.plan.numel:,} values per learner (1/{sample.fraction:.0f} "
        f"of the columns), memories {format_bytes(screened)}; then the "
        f"survivors on the whole model, memories at most {format_bytes(every)} if all "
        f"survive, {where}."
    )


def kept_text(run: Replay, kept: Sequence[int]) -> str:
    """The line said after the screen: what goes on to the whole model, and the memory
    its error-feedback memories take there."""
    schemes = [run.schemes[i][1] for i in kept]
    every = memory_bytes_needed(schemes, len(run.learners))
    place = "in RAM" if every <= run.compute.memory_bytes() else "in a scratch file"
    names = ", ".join(label(s) for s in schemes)
    return (
        f"screen kept {len(schemes)} for the whole model: {names}; error-feedback memories "
        f"{format_bytes(every)} {place}, beside each one's rows of a block in lockstep "
        "(docs/large.md)."
    )
