"""Recommend a compressor and rate from a replay: the fastest within an error budget
(docs/replay.md, "gradstat recommend").

Every candidate (compressor, ratio) is replayed on its communication plan
(:mod:`gradstat.analysis.replay`; on a large capture only those that survive the screen
on a column sample, :mod:`gradstat.analysis.screening`); one that fails is one warning.
Its time per step is the alpha-beta communication time at ``cost_learners``
(docs/methods.md 5) plus one learner's compression time: measured here for
``cpu-here`` (:mod:`gradstat.analysis.pricing`), else the work model on the target's
profile (:mod:`gradstat.compressors.work`, :mod:`gradstat.compressors.targets`). The
fastest within the budget wins, judged against the dense ring all-reduce in fp32 or
fp16; on an FSDP2 capture, against FSDP's reduce-scatter in its reduce dtype plus the
parameter all-gather (added to every candidate too), among the candidates with a
reduce-scatter form; under HSDP (R replicas) the reduce-scatter and the candidates run
in shard groups of ``cost_learners / R``, the baseline pays the dense replicate
all-reduce of its shard, and so does every candidate unless the plan compresses the
replicate stage (:attr:`~gradstat.compressors.plan.Message.replicate_compressed`, as
gradstat's own ``--hsdp`` with a compressor runs it: the replay prices the candidate's
stage 2 then). Build-up is extrapolated to ``cost_learners`` with
:mod:`gradstat.analysis.cluster`'s stated model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import pandas as pd

from gradstat import defaults
from gradstat.analysis.cluster import BuildupModel, buildup_model
from gradstat.analysis.compute import Compute
from gradstat.analysis.pricing import measure_price, rounds_for
from gradstat.analysis.replay import Replay, ReplayParams, dense_seconds, summarize_replay
from gradstat.analysis.screening import (
    SCREEN_VALUES,
    Screen,
    announce,
    kept_text,
    sample_for,
    screen,
)
from gradstat.analysis.selection import Selection, as_link
from gradstat.compressors.cost import (
    Link,
    allgather_seconds,
    allreduce_seconds,
    reducescatter_seconds,
)
from gradstat.compressors.registry import REGISTRY, CompressorSpec
from gradstat.compressors.spec import parse_compressors
from gradstat.compressors.targets import Target, builtin_target, spread_text
from gradstat.compressors.work import seconds
from gradstat.errors import UsageError
from gradstat.parallel.progress import Progress, no_progress
from gradstat.store import Capture

#: Every registered compressor except the dense baseline.
DEFAULT_CANDIDATES = ",".join(name for name, entry in REGISTRY.items() if entry.candidate)
#: On an FSDP2 capture: every compressor with a reduce-scatter form, every format.
FSDP_CANDIDATES = ",".join(
    name
    for name, entry in REGISTRY.items()
    if entry.reduce_scatter and (entry.candidate or "algorithm" in entry.params)
)
DEFAULT_RATIOS = "0.1,0.01,0.001"
BASELINE_BYTES = {"fp32": 4, "fp16": 2}
#: FSDP2's reduce dtypes as the answers name them, and their bytes.
REDUCE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
REDUCE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
#: What an FSDP2 recommendation compares against (``Recommendation.dense``).
FSDP_DENSE = "FSDP2 ring reduce-scatter + parameter all-gather"
#: The same under HSDP: the shard groups' reduce-scatter, then the replicas' all-reduce.
HSDP_DENSE = "HSDP ring reduce-scatter + replicate all-reduce + parameter all-gather"
#: The collective algorithms the alpha-beta model assumes (gradstat/compressors/cost.py).
ALGORITHMS = {
    "allreduce": "ring",
    "allgather": "ring",
    "reducescatter": "ring",
    "broadcast": "binomial tree",
    "reduce": "binomial tree",
}


@dataclass
class Recommendation:
    """The outcome: ``winner`` (a ranking row) or ``None`` when no candidate fits the budget.

    ``ranking`` has one row per candidate: within budget first, fastest first; then the
    others, smallest error first. ``settings`` are the winner's concrete settings.
    """

    error_budget: float
    baseline: str
    baseline_seconds: float
    steps: list[int]
    learners: int
    cost_learners: int
    link: Link
    ranking: pd.DataFrame
    winner: dict | None
    settings: dict[str, float]
    target: Target | None = None
    buildup: dict[str, BuildupModel] | None = None
    #: How compression was priced: ``measured`` here, or ``estimated`` for the target.
    priced: str = "measured"
    #: The plan every candidate ran on (``plan.describe()``), and the memories used.
    plan: str = "model"
    #: The screen on a column sample, when one ran (:mod:`gradstat.analysis.screening`).
    screen: Screen | None = None
    #: The dense collective judged against, after its dtype (``baseline``).
    dense: str = "ring all-reduce"
    #: FSDP2: the candidates left out (no reduce-scatter form).
    left_out: tuple[str, ...] = ()

    def assumptions(self) -> list[str]:
        """What the prediction assumes: target, link, collective algorithms, cluster."""
        algorithms = ", ".join(f"{c} {a}" for c, a in ALGORITHMS.items())
        lines = [
            f"cluster: {self.cost_learners} learners (the capture has {self.learners}); "
            f"link: {self.link.bandwidth * 8 / 1e9:.4g} Gbit/s per learner, latency "
            f"{self.link.latency * 1e6:.4g} us; collectives: {algorithms} (alpha-beta model)",
        ]
        lines.append(f"granularity: {self.plan}; memory: as each candidate names it")
        if self.priced == "measured" and self.screen is not None and self.screen.prices:
            lines.append(
                "compression time: measured here, each candidate's own code on the "
                f"screen's sample of {self.screen.values:,} values per learner, times "
                f"{self.screen.fraction:.3g} (thread CPU time, median of warm runs)"
            )
        elif self.priced == "measured":
            lines.append(
                "compression time: measured here, each candidate's own code on the "
                "capture's messages (thread CPU time, median of warm runs; number "
                "formats: the work model's casts, their collective is emulated)"
            )
        elif self.target is not None:
            t = self.target
            lines.append(
                f"target: {t.name} ({t.description}); compression time estimated = work "
                f"model x profile: memory {t.bandwidth / 1e9:.3g} GB/s"
                f"{spread_text(t, 'bandwidth')}, top-k {t.topk_rate / 1e9:.3g} G "
                f"elements/s{spread_text(t, 'topk_rate')}, launch {t.launch * 1e6:.3g} us"
            )
        for label, model in (self.buildup or {}).items():
            if self.cost_learners > self.learners and math.isfinite(model.at_cluster):
                measured = ", ".join(f"{b:.3g}" for b in model.measured)
                lines.append(
                    f"build-up of {label}: measured B(1..{self.learners}) = {measured}; "
                    f"B(m) = B(1) m^{model.exponent:.3g} gives B({self.cost_learners}) = "
                    f"{model.at_cluster:.3g}"
                )
                break
        return lines

    @property
    def pays_off(self) -> bool:
        """Whether the winner beats the dense baseline."""
        return self.winner is not None and self.winner["seconds"] < self.baseline_seconds

    @property
    def closest(self) -> dict:
        """The candidate with the smallest mean error (what to show when none fits)."""
        return self.ranking.sort_values("rel_error").iloc[0].to_dict()

    def explanation(self) -> list[str]:
        """Why the winner won and what came next, in sentences."""
        if self.winner is None:
            c = self.closest
            return [
                f"No candidate keeps the mean relative error within {self.error_budget:g}; "
                f"the closest is {_name(c)} with {c['rel_error']:.3g}."
            ]
        w = self.winner
        lines = [
            f"{_name(w)}: predicted {_ms(w['seconds'])} per step "
            f"({_ms(w['comm_seconds'])} communication + {_ms(w['compress_seconds'])} "
            f"compression) for {self.cost_learners} learners, against "
            f"{_ms(self.baseline_seconds)} for the dense {self.baseline} {self.dense} "
            f"({self.baseline_seconds / w['seconds']:.3g}x); mean relative error "
            f"{w['rel_error']:.3g} within the budget {self.error_budget:g}."
        ]
        if not self.pays_off:
            lines.append(
                f"It does not beat the dense {self.baseline} {self.dense}: keep dense "
                "communication unless the network is slower than assumed."
            )
        if self.dense in (FSDP_DENSE, HSDP_DENSE):
            lines.append(fsdp_note(self.left_out))
        fitting = self.ranking[self.ranking["within_budget"]]
        if len(fitting) > 1:
            r = fitting.iloc[1].to_dict()
            lines.append(f"Next: {_name(r)} at {_ms(r['seconds'])} (error {r['rel_error']:.3g}).")
        faster = self.ranking[
            ~self.ranking["within_budget"] & (self.ranking["seconds"] < w["seconds"])
        ]
        if len(faster):
            f = faster.sort_values("seconds").iloc[0].to_dict()
            lines.append(
                f"Faster but over budget: {_name(f)} at {_ms(f['seconds'])} "
                f"(error {f['rel_error']:.3g})."
            )
        if self.cost_learners != self.learners:
            lines.append(
                f"Errors were measured with {self.learners} learners; the cost model and "
                f"the build-up are extrapolated to {self.cost_learners}."
            )
        return lines

    def to_dict(self) -> dict:
        """A JSON-ready document (what ``--json`` prints and ``--out`` writes)."""
        winner = None
        if self.winner is not None:
            winner = {
                "compressor": self.winner["compressor"],
                "memory": self.winner.get("memory"),
                "ratio": _ratio(self.winner["ratio"]),
                "settings": self.settings,
                **{key: self.winner[key] for key in _KEYS},
            }
        return {
            "recommendation": winner,
            "pays_off": self.pays_off,
            "error_budget": self.error_budget,
            "baseline": self.baseline,
            "baseline_seconds": self.baseline_seconds,
            "dense": self.dense,
            "left_out": list(self.left_out),
            "steps": self.steps,
            "learners": self.learners,
            "cost_learners": self.cost_learners,
            "cluster_size": self.cost_learners,
            "bandwidth_bytes_per_second": self.link.bandwidth,
            "latency_seconds": self.link.latency,
            "link": {
                "bandwidth_bytes_per_second": self.link.bandwidth,
                "latency_seconds": self.link.latency,
                "algorithms": ALGORITHMS,
                "model": "alpha-beta (METHODS.md 5)",
            },
            "target": self.target.to_dict() if self.target is not None else None,
            "priced": self.priced,
            "granularity": self.plan,
            "buildup": {k: v.to_dict() for k, v in (self.buildup or {}).items()},
            "screen": self.screen.to_dict() if self.screen is not None else None,
            "assumptions": self.assumptions(),
            "explanation": self.explanation(),
            "candidates": [
                {
                    "compressor": row["compressor"],
                    "memory": row.get("memory"),
                    "ratio": _ratio(row["ratio"]),
                    **{key: row[key] for key in _KEYS},
                    "within_budget": bool(row["within_budget"]),
                }
                for row in self.ranking.to_dict(orient="records")
            ],
        }


_KEYS = (
    "rel_error",
    "cosine",
    "density",
    "buildup",
    "bytes_per_learner",
    "comm_seconds",
    "compress_seconds",
    "measured_compress_seconds",
    "measured_compress_spread",
    "buildup_at_cluster",
    "seconds",
    "speedup",
)


def _ratio(value: float) -> float | None:
    return None if value is None or math.isnan(value) else float(value)


def _name(row: dict) -> str:
    """A candidate as the answer names it: its spec, ratio and the memory it ran with."""
    ratio = _ratio(row["ratio"])
    name = row["compressor"] if ratio is None else f"{row['compressor']} at ratio {ratio:g}"
    memory = row.get("memory")
    return name if not isinstance(memory, str) else f"{name} (memory {memory})"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def check_options(error_budget: float, baseline: str, cost_learners: int | None) -> None:
    """Refuse a bad budget, baseline or cluster size before any replay starts."""
    if not (error_budget > 0 and math.isfinite(error_budget)):
        raise UsageError(f"error_budget={error_budget}: must be a positive number")
    if baseline not in BASELINE_BYTES:
        raise UsageError(f"baseline={baseline!r}: choose fp32 or fp16")
    if cost_learners is not None and cost_learners < 2:
        raise UsageError(f"cost_learners={cost_learners}: a cluster needs at least 2 learners")


@dataclass(frozen=True)
class RecommendParams:
    """What to choose among and how to judge: the ``error_budget`` (largest acceptable
    mean relative error), the ``link`` and ``cost_learners`` of the cost model, the dense
    ``baseline`` (fp32 or fp16), candidate ``compressors`` and ``ratios``, ``seed``, the
    ``target`` hardware compression is timed on (default ``cpu-here``), the torch
    ``threads`` the replay measures compression with, and ``screen``: the values per
    learner of the column sample every candidate is screened on first (0: none;
    :mod:`gradstat.analysis.screening`)."""

    error_budget: float = defaults.ERROR_BUDGET  # as `gradstat report`
    link: Link = None  # a Link, "10Gbit/s[,5us]" or (bandwidth, latency); None: defaults
    cost_learners: int | None = None
    baseline: str = "fp32"
    compressors: str | Sequence[CompressorSpec] = DEFAULT_CANDIDATES
    ratios: str | Sequence[float] = DEFAULT_RATIOS
    seed: int = 0
    target: Target | None = None
    threads: int = 1
    granularity: str | None = None
    dense: str | None = None
    dense_below: int = 0
    screen: int = SCREEN_VALUES

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "error_budget", float(self.error_budget))
        set_(self, "link", as_link(self.link))
        if self.cost_learners is not None:
            set_(self, "cost_learners", int(self.cost_learners))
        check_options(self.error_budget, self.baseline, self.cost_learners)

    def replay_params(self) -> ReplayParams:
        """The replay of every candidate; a candidate that cannot run or fails is
        skipped with a warning."""
        return ReplayParams(
            self.compressors,
            self.ratios,
            self.link,
            cost_learners=self.cost_learners,
            seed=self.seed,
            skip_unfit=True,
            threads=self.threads,
            granularity=self.granularity,
            dense=self.dense,
            dense_below=self.dense_below,
            tolerate=True,
        )


def recommend(
    capture: Capture,
    selection: Selection | None = None,
    params: RecommendParams | None = None,
    *,
    compute: Compute | None = None,
    progress: Progress = no_progress,
    say: Callable[[str], None] = lambda text: None,
) -> Recommendation:
    """Replay the candidates over the selection (the whole model by default) and pick the
    fastest within budget. Ratios a sparsifier cannot honour on this capture are skipped
    with a warning. On a large capture the candidates are screened on a column sample
    first (:mod:`gradstat.analysis.screening`) and only those that can still win replay
    the whole model; ``say`` gets the line of what will run (before the work), one per
    group the screen dropped and one naming the candidates it kept."""
    if params is None:
        raise UsageError("a recommendation needs parameters: RecommendParams(error_budget, link)")
    compressors, left_out = fsdp_candidates(capture, params.compressors)
    params = replace(params, compressors=compressors)
    run = Replay(capture, selection, params.replay_params(), compute=compute)
    sample = sample_for(run.selection.scopes(capture)[0], run.plan, params.screen)
    if len(run.plans) > 1 or len(run.schemes) < 2:
        sample = None
    say(announce(run, sample))
    screened = None
    if sample is not None:
        target = params.target or builtin_target("cpu-here")

        def compress(i: int) -> float | None:  # None: measured on the sample
            return _modelled(run.schemes[i][1], run.cost_learners, target)

        screened = screen(run, sample, params.error_budget, compress=compress, progress=progress)
        for group in screened.dropped:
            say(f"screen dropped {len(group.names)} ({group.why}): {', '.join(group.names)}")
        say(kept_text(run, screened.survivors))
    records = run.run(progress, only=screened.survivors if screened is not None else None)
    result = choose(
        run,
        records,
        error_budget=params.error_budget,
        baseline=params.baseline,
        target=params.target,
        screened=screened,
    )
    return replace(result, left_out=tuple(left_out))


def fsdp_reduce(capture: Capture) -> str | None:
    """The dtype an FSDP2 capture's units reduce in (``bf16``, ``fp16``, ``fp32``; the
    widest where units differ); None for a capture of another kind."""
    if capture.meta.get("data_parallel") != "fsdp2":
        return None
    units = json.loads(capture.meta.get("fsdp_units") or "[]")
    names = {REDUCE_NAMES.get(u.get("reduce_dtype"), "fp32") for u in units} or {"fp32"}
    return max(names, key=lambda name: REDUCE_BYTES[name])


def fsdp_replicas(capture: Capture) -> int:
    """HSDP's replicas R of an FSDP2 capture (the most any unit has; 1 without HSDP)."""
    units = json.loads(capture.meta.get("fsdp_units") or "[]")
    return max((int(u.get("replicate", 1)) for u in units), default=1)


def fsdp_seconds(
    numel: int, shard: int, replicas: int, link: Link, reduce: str
) -> tuple[float, float, float]:
    """``(gradient reduce-scatter, HSDP's replicate all-reduce, parameter all-gather)``
    seconds of one FSDP2 step of ``numel`` values in ``reduce``: the reduce-scatter
    within a shard group of ``shard`` learners; the ring all-reduce of each shard over
    ``replicas``; the all-gather within the shard group (once, in the same dtype)."""
    size = REDUCE_BYTES[reduce]
    part = numel * size / shard
    scatter = reducescatter_seconds(numel * size, shard, link)
    return scatter, allreduce_seconds(part, replicas, link), allgather_seconds(part, shard, link)


def fsdp_candidates(
    capture: Capture, compressors: str | Sequence[CompressorSpec]
) -> tuple[str | Sequence[CompressorSpec], list[str]]:
    """``(candidates, labels left out)``: on an FSDP2 capture those that can run inside
    the reduce-scatter (the default set becomes :data:`FSDP_CANDIDATES`; a sparse
    all-gather has no reduce-scatter form), on any other ``compressors`` as given."""
    if fsdp_reduce(capture) is None:
        return compressors, []
    names = compressors.split(",") if isinstance(compressors, str) else compressors
    if [getattr(c, "name", c) for c in names] == DEFAULT_CANDIDATES.split(","):
        compressors = FSDP_CANDIDATES  # the default set: FSDP's own
    specs = parse_compressors(compressors) if isinstance(compressors, str) else compressors
    kept = [s for s in specs if s.entry.reduce_scatter or s.collective == "allreduce"]
    left_out = [s.label for s in specs if s not in kept]
    if not kept:
        raise UsageError(f"none of the candidates can run under FSDP2. {fsdp_note(left_out)}")
    return kept, left_out


def fsdp_note(left_out: Sequence[str]) -> str:
    """The answer's sentence on what FSDP2 left out."""
    dropped = f" (left out: {', '.join(left_out)})" if left_out else ""
    return (
        "Under FSDP2 each unit's gradient is one message inside the reduce-scatter: "
        "number formats and compressors whose payloads add up run there; sparsifiers "
        f"that all-gather their payloads have no reduce-scatter form{dropped}."
    )


def _scheme_of(run: Replay, row) -> tuple:
    ratio = _ratio(row.ratio)
    return next(
        (sc, s)
        for sc, s in run.schemes
        if sc.name == row.scope and s.spec.label == row.compressor and _ratio(s.ratio) == ratio
    )


def _modelled(scheme, n: int, target: Target) -> float | None:
    """One learner's compression seconds on ``target`` by every message's work model,
    where they are not measured here (None): on another target, and for a number format,
    whose collective gradstat emulates (timing it would price the emulator)."""
    first = scheme.plan.compressed[:1]
    emulated = bool(first) and scheme.compressor(0, first[0]).emulated
    if target.name == "cpu-here" and not emulated:
        return None
    total = 0.0
    for m, message in enumerate(scheme.plan.messages):
        if not message.dense:
            work = scheme.compressor(0, m).work(message.numel, scheme.memory)
            total += seconds(work.online(n), target)
    return total


def target_times(
    run: Replay,
    ranking: pd.DataFrame,
    records: pd.DataFrame,
    target: Target,
    prices: Mapping[int, float] | None = None,
) -> dict[str, BuildupModel]:
    """Replace the replay's compression time by one learner's in training at the cluster
    size (in place): measured here for ``cpu-here`` (``prices`` by scheme index where the
    screen measured them on its sample, else :func:`~gradstat.compressors.
    pricing.measure_price` on the first replayed step's row of the first learner), else
    (and for a number format) the work model on ``target``; add ``buildup_at_cluster``;
    return the build-up models."""
    n, replayed = run.cost_learners, len(run.learners)
    models: dict[str, BuildupModel] = {}
    compress, buildup = [], []
    prices = prices or {}
    row = None
    for line in ranking.itertuples():
        ratio = _ratio(line.ratio)
        scope, scheme = _scheme_of(run, line)
        index = run.schemes.index((scope, scheme))
        modelled = _modelled(scheme, n, target)
        if modelled is not None:
            compress.append(modelled)
        elif index in prices:
            compress.append(prices[index])
        else:
            if row is None:
                import torch

                row = torch.from_numpy(run.capture.read_row(run.steps[0], run.learners[0]).copy())
            part = scope.take(row)
            rounds = rounds_for(line.compress_seconds)  # the replay's time of its step
            price = measure_price(scheme, part, replayed, extrapolate=n != replayed, rounds=rounds)
            compress.append(price.at(n))
        mask = (records["compressor"] == line.compressor) & (
            records["ratio"].fillna(-1) == (ratio if ratio is not None else -1)
        )
        mask &= records["message"].isna() & (records["scope"] == line.scope)
        model = buildup_model(records[mask], n)
        if model is not None:
            models[_name({"compressor": line.compressor, "ratio": line.ratio})] = model
        buildup.append(model.at_cluster if model is not None else math.nan)
    ranking["measured_compress_seconds"] = ranking["compress_seconds"]
    ranking["measured_compress_spread"] = ranking.pop("compress_spread")
    ranking["compress_seconds"] = compress
    ranking["buildup_at_cluster"] = buildup
    ranking["seconds"] = ranking["comm_seconds"] + ranking["compress_seconds"]
    return models


def choose(
    run: Replay,
    records: pd.DataFrame,
    *,
    error_budget: float,
    baseline: str = "fp32",
    target: Target | None = None,
    screened: Screen | None = None,
) -> Recommendation:
    """Rank the candidates of a finished replay (``run`` produced ``records``) and pick
    the fastest whose mean relative error is within ``error_budget``; compression times
    are the work model's on ``target`` (default ``cpu-here``: measured, on the sample of
    the ``screened`` candidates where a screen ran)."""
    check_options(error_budget, baseline, None)
    link, n = run.link, run.cost_learners
    dense, reduce = "ring all-reduce", fsdp_reduce(run.capture)
    replicas = 1 if reduce is None else min(n, fsdp_replicas(run.capture))
    shard = max(1, n // replicas)  # the learners of a shard group
    target = target or builtin_target("cpu-here")
    ranking = summarize_replay(records, link, n)
    prices = screened.prices if screened is not None else None
    models = target_times(run, ranking, records, target, prices)
    ranking["within_budget"] = ranking["rel_error"] <= error_budget
    ranking = pd.concat(
        [
            ranking[ranking["within_budget"]].sort_values(["seconds", "rel_error"], kind="stable"),
            ranking[~ranking["within_budget"]].sort_values("rel_error", kind="stable"),
        ],
        ignore_index=True,
    )
    if reduce is None:
        base = dense_seconds(run.capture.numel, n, link, BASELINE_BYTES[baseline])
    else:  # FSDP2: the run's reduce-scatter; the rest stays the same for everyone
        scatter, replicate, fixed = fsdp_seconds(run.capture.numel, shard, replicas, link, reduce)
        base, baseline = scatter + replicate + fixed, reduce
        if not any(m.replicate_compressed for m in run.plan.messages):  # FSDP's, dense
            fixed += replicate
        dense = FSDP_DENSE if replicas == 1 else HSDP_DENSE
        for column in ("comm_seconds", "seconds"):
            ranking[column] = ranking[column] + fixed
    ranking["speedup"] = base / ranking["seconds"]
    winner = ranking.iloc[0].to_dict() if bool(ranking["within_budget"].iloc[0]) else None
    settings = {} if winner is None else _winner_settings(run, records, winner)
    return Recommendation(
        error_budget=error_budget,
        baseline=baseline,
        baseline_seconds=base,
        steps=run.steps,
        learners=len(run.learners),
        cost_learners=n,
        link=link,
        ranking=ranking,
        winner=winner,
        settings=settings,
        target=target,
        buildup=models,
        priced="measured" if target.name == "cpu-here" else "estimated",
        plan=run.plan.describe(),
        screen=screened,
        dense=dense,
    )


def _winner_settings(run: Replay, records: pd.DataFrame, winner: dict) -> dict[str, float]:
    """The concrete settings of the ``winner``'s scheme in ``run``, with the mean threshold
    it used over ``records`` where the scheme has no fixed threshold of its own."""
    label, ratio = winner["compressor"], _ratio(winner["ratio"])
    scheme = next(s for _, s in run.schemes if s.spec.label == label and _ratio(s.ratio) == ratio)
    settings = scheme.settings()
    threshold = records.loc[
        (records["compressor"] == label) & (records["ratio"].fillna(-1) == (ratio or -1)),
        "threshold",
    ].mean()
    if math.isfinite(threshold) and "threshold" not in settings:
        settings["mean_threshold"] = float(threshold)
    return settings
