"""What the sections of ``gradstat report`` share: the settings, the capture and the
analyses several sections read (:class:`ReportContext`: the replay runs once, for both
the replay and the recommendation sections), and what one section returns (:class:`Part`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

import pandas as pd

from gradstat import defaults
from gradstat.analysis.compute import Compute
from gradstat.analysis.recommend import Recommendation, choose, fsdp_candidates
from gradstat.analysis.replay import Replay, ReplayParams, summarize_replay
from gradstat.analysis.selection import Selection
from gradstat.compressors.cost import Link, parse_bandwidth, parse_latency
from gradstat.compressors.targets import Target, builtin_target
from gradstat.parallel.progress import Progress
from gradstat.store import Capture
from gradstat.threads import torch_threads


@dataclass
class ReportSettings:
    """What the report computes; the defaults are those of the commands it stands for."""

    ratios: Sequence[float] = defaults.RATIOS
    compressors: str = defaults.REPORT_COMPRESSORS
    error_budget: float = defaults.ERROR_BUDGET
    link: Link = field(
        default_factory=lambda: Link(
            parse_bandwidth(defaults.BANDWIDTH), parse_latency(defaults.LATENCY)
        )
    )
    cost_learners: int | None = None
    fit_steps: int = 5
    dpi: int = defaults.REPORT_DPI
    compute: Compute = field(default_factory=Compute)
    #: The hardware compression is priced on; None: ``cpu-here``, measured once on the
    #: replay's threads (pass a ``recommend --out`` file's profile to quote its numbers).
    target: Target | None = None
    #: Where ``target`` came from (``--target-file``), for the equivalent command.
    target_file: str | None = None
    #: Runs to compare the capture with (``--with``: the training section), and the
    #: compressors of those trained with a user's class (``--trained-with``).
    with_runs: Sequence[str] = ()
    trained_with: Mapping[str, str] = field(default_factory=dict)
    #: The replay's plan: granularity (None: the capture's own) and dense exclusions.
    granularity: str | None = None
    dense: str | None = None
    dense_below: int = 0


@dataclass
class Part:
    """What a section's build returns: the reading (a paragraph on what the numbers
    show), figures, ``(caption, table)`` pairs and its lines for the summary box."""

    reading: str
    figures: list = field(default_factory=list)
    tables: list[tuple[str, pd.DataFrame]] = field(default_factory=list)
    verdict: list[str] = field(default_factory=list)


class ReportContext:
    """The capture, the settings and what several sections share (the replay, once)."""

    def __init__(
        self, cap: Capture, settings: ReportSettings, progress: Callable[[str], Progress]
    ) -> None:
        self.cap, self.settings, self.progress = cap, settings, progress
        self.selection = Selection.of(cap)  # the whole capture
        self.compute = settings.compute

    @cached_property
    def replay(self) -> tuple[Replay, pd.DataFrame]:
        s = self.settings
        compressors, self.left_out = fsdp_candidates(self.cap, s.compressors)  # FSDP2's
        params = ReplayParams(
            compressors,
            s.ratios,
            s.link,
            cost_learners=s.cost_learners,
            skip_unfit=True,
            granularity=s.granularity,
            dense=s.dense,
            dense_below=s.dense_below,
            tolerate=True,  # a candidate that fails is one warning; the others still run
        )
        run = Replay(self.cap, self.selection, params, compute=self.compute)
        return run, run.run(self.progress("replay"))

    @cached_property
    def target(self) -> Target:
        """The profile every compression time of the page is priced with (one, so a
        configuration has one time everywhere on the page)."""
        if self.settings.target is not None:
            return self.settings.target
        with torch_threads(defaults.THREADS):
            return builtin_target("cpu-here")

    @cached_property
    def recommendation(self) -> Recommendation:
        run, records = self.replay
        result = choose(run, records, error_budget=self.settings.error_budget, target=self.target)
        return replace(result, left_out=tuple(self.left_out))

    @cached_property
    def priced(self) -> pd.DataFrame:
        """The replay's summary in replay order, with the recommendation's times (the
        work model on :attr:`target` at the cluster size) beside the measured ones."""
        run, records = self.replay
        keys = ["scope", "compressor", "ratio"]
        order = summarize_replay(records, self.settings.link, run.cost_learners)[keys]
        return order.merge(self.recommendation.ranking, on=keys, how="left")

    @property
    def cost_learners(self) -> int:
        """The cluster size of the cost model: as set, else the run's world size."""
        return self.settings.cost_learners or self.cap.world_size


@dataclass(frozen=True)
class SectionSpec:
    """One section of the page: its anchor, its heading and the function building it."""

    key: str
    title: str
    build: Callable[[ReportContext], Part]
