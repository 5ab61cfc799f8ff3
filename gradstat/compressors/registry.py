"""The compressor registry: every built-in's name, parameters, rate and memory, and the
:class:`Scheme` that runs a spec (parsed by :mod:`gradstat.compressors.spec`; a choice
parameter stored as the index of its word in :data:`CHOICES`) over a plan.

A sparsifier applies its density to every message of the plan (``k = max(1, round(ratio
* numel))`` for the built-ins, GRACE's ``max(1, int(numel * ratio))`` for a user's
class); a fixed-rate compressor ignores ``--ratios`` and is replayed once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import import_module
from typing import Any

import torch

from gradstat.compressors.base import Compressor
from gradstat.compressors.exchange import Call
from gradstat.compressors.memory import DGCMemory, Memory, NoMemory, ResidualMemory, TensorRows
from gradstat.compressors.plan import Plan, replicate_plan
from gradstat.compressors.simulated import Reduce, sum_in_order
from gradstat.errors import UsageError
from gradstat.stats.density import k_for
from gradstat.stats.sidco import STAGE_FITS, ZEROS
from gradstat.wire.collectives import ACCUMULATE, ALGORITHMS

#: Parameters that take a word: their choices, stored by index (the default is index 0).
CHOICES: dict[str, tuple[str, ...]] = {
    "zeros": ZEROS,
    "stage_fit": STAGE_FITS,
    "algorithm": ALGORITHMS,
    "accumulate": ACCUMULATE,
}


@dataclass(frozen=True)
class Context:
    """What a compressor is built for, once per learner and message: its registry
    ``name``, its rate and ``k`` there, the message's size and its parameters'
    ``shapes``, the compressor's parameters, the scheme's ``seed``, the ``learner`` and
    the plan's ``granularity`` (``unit``: the message runs inside FSDP2's
    reduce-scatter)."""

    name: str
    ratio: float | None
    k: int | None
    numel: int
    shapes: tuple[tuple[int, ...], ...]
    params: Mapping[str, float]
    seed: int
    learner: int = 0
    granularity: str = "model"


def grace_k(ratio: float, numel: int) -> int:
    """GRACE's elements kept of ``numel`` at density ``ratio``: ``max(1, int(numel * ratio))``."""
    return max(1, int(numel * ratio))


@dataclass(frozen=True)
class Entry:
    """One registered compressor: how to build it (once per learner and message),
    whether its rate is fixed (it ignores ``--ratios``), and its parameters with their
    defaults. ``build``: a function of the :class:`Context`, or ``"MODULE[:FUNCTION]"``
    naming one in ``gradstat.compressors`` (``FUNCTION`` defaults to ``build``), imported
    on first use; ``fits``: likewise a function of the plan and parameters that refuses a
    plan the compressor cannot run on (PowerSGD without a matrix)."""

    build: Callable[[Context], Compressor] | str
    fixed_rate: bool
    summary: str
    params: Mapping[str, float] = field(default_factory=dict)
    #: Among ``recommend``'s default candidates (reference behaviours run on request).
    candidate: bool = True
    #: The collectives ``:collective=`` may choose (the first is the default); empty for a
    #: compressor with an exchange of its own (CLT-k's broadcast, gTop-k's tree).
    collectives: tuple[str, ...] = ("allgather",)
    #: Elements a density keeps of a message: the built-ins' rule, or GRACE's.
    k_rule: Callable[[float, int], int] = k_for
    fits: str | None = None
    #: Parameters every label states, default or not (a format's algorithm and
    #: accumulation).
    shown: tuple[str, ...] = ()
    #: Whether it can run inside FSDP2's reduce-scatter (``--granularity unit``): formats
    #: and compressors whose payloads add up element-wise (docs/compressors.md).
    reduce_scatter: bool = False

    def _function(self, named: Callable | str, default: str) -> Callable:
        if callable(named):
            return named
        module, _, function = named.partition(":")
        home = import_module(f"gradstat.compressors.{module}")
        return getattr(home, function or default)

    def make(self, context: Context) -> Compressor:
        """One learner's compressor object for one message."""
        return self._function(self.build, "build")(context)

    def check(self, plan: Plan, params: Mapping[str, float]) -> None:
        """Refuse a plan the compressor cannot run on (a :class:`UsageError`)."""
        if self.fits is not None:
            self._function(self.fits, "fits")(plan, params)


_SIDCO = {"stages": 0.0, "zeros": 0.0, "stage_fit": 0.0}
#: A format's parameters: ``algorithm`` and ``accumulate`` (indices into their choices:
#: ``ring``, ``fp32`` by default).
_FORMAT = {"algorithm": 0.0, "accumulate": 0.0}


def _format(summary: str, candidate: bool = False) -> Entry:
    """A number format as a compressor (:mod:`gradstat.compressors.cast`)."""
    return Entry(
        "cast",
        True,
        f"{summary}; emulated ring, tree or a2a",
        _FORMAT,
        candidate=candidate,
        collectives=(),
        shown=("algorithm", "accumulate"),
        reduce_scatter=True,
    )


#: Payloads that add up element-wise: all-reduced by default, all-gathered on request.
_SUMS = ("allreduce", "allgather")
#: Every built-in compressor: one module each, one line here.
REGISTRY: dict[str, Entry] = {
    "none": Entry(
        "none",
        True,
        "dense float32 all-reduce",
        candidate=False,
        collectives=_SUMS,
        reduce_scatter=True,
    ),
    "fp16": _format("float16", candidate=True),
    "bf16": _format("bfloat16", candidate=True),
    "fp8-e4m3": _format("fp8 E4M3, one scale per message"),
    "fp8-e5m2": _format("fp8 E5M2, one scale per message"),
    "mxfp8": _format("OCP MX fp8 (E4M3, 32-value blocks)"),
    "mxfp6": _format("OCP MX fp6 (E2M3, 32-value blocks)"),
    "mxfp4": _format("OCP MX fp4 (E2M1, 32-value blocks)"),
    "topk": Entry("topk", False, "exact top-k, all-gather"),
    "randomk": Entry(
        "randomk",
        False,
        "random-k with a shared seed, all-reduce of values",
        collectives=(),
        reduce_scatter=True,
    ),
    "threshold": Entry(
        "estimated",
        False,
        "fixed hard threshold (calibrated on the first step unless threshold= is given)",
        {"threshold": 0.0},
    ),
    "dgc": Entry(
        "estimated",
        False,
        "DGC sampled threshold with momentum correction and factor masking",
        {"momentum": 0.9},
    ),
    "gaussiank": Entry("estimated", False, "Gaussian-k threshold"),
    "redsync": Entry("estimated", False, "RedSync binary-search threshold"),
    "redsync-sidco": Entry(
        "estimated",
        False,
        "RedSync as the SIDCo reference (3 probes)",
        candidate=False,
    ),
    "sidco-exp": Entry("estimated", False, "SIDCo-E (exponential)", _SIDCO),
    "sidco-gpd": Entry("estimated", False, "SIDCo-P (GPD)", _SIDCO),
    "sidco-gamma-gpd": Entry("estimated", False, "SIDCo-GP (gamma, then GPD)", _SIDCO),
    "clt-k": Entry(
        "cltk",
        False,
        "ScaleCom cyclic local top-k with low-pass memory",
        {"beta": 1.0},
        collectives=(),
        reduce_scatter=True,
    ),
    "gtopk": Entry("gtopk", False, "global top-k by tree merge", collectives=()),
    "powersgd": Entry(
        "powersgd",
        True,
        "PowerSGD rank-r, warm-started",
        {"rank": 4},
        collectives=(),
        fits="powersgd:fits",
        reduce_scatter=True,
    ),
    "signsgd": Entry("signsgd", True, "signSGD with majority vote"),
    "ef-signsgd": Entry("signsgd", True, "scaled sign with error feedback"),
    "qsgd": Entry(
        "qsgd", True, "QSGD stochastic levels per bucket", {"levels": 127, "bucket": 512}
    ),
    "terngrad": Entry("terngrad", True, "TernGrad ternary"),
}


@dataclass(frozen=True)
class CompressorSpec:
    """A compressor name with its parameters (registry defaults filled in); ``memory``:
    the error-feedback memory named after ``+`` (a
    :class:`~gradstat.compressors.spec.MemorySpec`; None: the compressor's own default);
    ``collective``: ``allgather`` or ``allreduce`` given as ``:collective=``, else None."""

    name: str
    params: tuple[tuple[str, float], ...] = ()
    memory: Any = None
    collective: str | None = None

    @property
    def entry(self) -> Entry:
        return REGISTRY[self.name]

    @property
    def fixed_rate(self) -> bool:
        return self.entry.fixed_rate

    @property
    def base_label(self) -> str:
        """``name`` plus the parameters that differ from the defaults."""
        changed = [
            f"{key}={CHOICES[key][int(value)] if key in CHOICES else format(value, 'g')}"
            for key, value in self.params
            if value != self.entry.params[key] or key in self.entry.shown
        ]
        return ":".join([self.name, *changed])

    @property
    def label(self) -> str:
        """The spec as the user would write it: :attr:`base_label`, the collective and
        ``+MEMORY`` where given."""
        label = self.base_label
        if self.collective is not None:
            label += f":collective={self.collective}"
        return label if self.memory is None else f"{label}+{self.memory.label}"


#: The built-in memories named after ``+`` (their parameters: ``spec.MEMORIES``).
BUILTIN_MEMORIES = {"none": NoMemory, "residual": ResidualMemory, "dgc": DGCMemory}


class Scheme:
    """A compressor and its error-feedback memory over a plan, replayed over steps.

    Every learner has its own compressor object for every message (:meth:`compressor`,
    built on first use), as in training; ``memory`` serves them all. ``reference`` is
    the dense update an estimate is judged against: the mean gradient, or for DGC's
    memory the dense momentum update ``u = mu u + mean(g)`` that momentum correction
    stands in for (Lin et al. 2018, section 3.2). ``reduce``: the simulated all-reduce
    (:mod:`gradstat.compressors.simulated`).
    """

    def __init__(
        self,
        spec: Any,
        ratio: float | None,
        plan: Plan,
        seed: int = 0,
        reduce: Reduce = sum_in_order,
    ) -> None:
        self.spec, self.ratio, self.plan, self.seed, self.reduce = spec, ratio, plan, seed, reduce
        self._objects: dict[tuple[int, int], Compressor] = {}
        self._velocity: dict[int, torch.Tensor] = {}
        first = self.compressor(0, plan.compressed[0]) if plan.compressed else None
        self.memory = self._memory(first)
        self._replicate_stages: dict[int, Scheme] = {}

    def replicate_stage(self, shards: int, learners: int) -> Scheme:
        """The same compressor over the second stage of HSDP's compressed replicate
        all-reduce (:func:`~gradstat.compressors.plan.replicate_plan` of this plan, shard
        groups of ``shards`` learners): compressor objects and a memory of its own (rows
        in RAM for ``learners``), made once for each size of shard group."""
        if shards not in self._replicate_stages:
            plan = replicate_plan(self.plan, shards)
            stage = Scheme(self.spec, self.ratio, plan, self.seed, self.reduce)
            stage.memory.allocate(learners, plan, TensorRows)
            self._replicate_stages[shards] = stage
        return self._replicate_stages[shards]

    def _memory(self, first: Compressor | None) -> Memory:
        named = self.spec.memory
        if named is None:
            return first.memory() if first is not None else NoMemory()
        if named.builtin:
            return BUILTIN_MEMORIES[named.name](**dict(named.params))
        from gradstat.compressors.user import user_memory

        return user_memory(named)

    def k(self, message: int) -> int | None:
        """The elements a sparsifier keeps of ``message`` (None at a fixed rate)."""
        if self.ratio is None:
            return None
        return self.spec.entry.k_rule(self.ratio, self.plan.messages[message].numel)

    def compressor(self, learner: int, message: int) -> Compressor:
        """Learner ``learner``'s compressor object for ``message``."""
        key = (learner, message)
        if key not in self._objects:
            m = self.plan.messages[message]
            params = dict(self.spec.params)
            context = Context(
                self.spec.name,
                self.ratio,
                self.k(message),
                m.numel,
                m.shapes,
                params,
                self.seed,
                learner,
                self.plan.granularity,
            )
            made = self.spec.entry.make(context)
            if self.spec.collective is not None:
                made.collective = self.spec.collective
            self._objects[key] = made
        return self._objects[key]

    def call(self, learner: int, message: int, step: int, learners: int) -> Call:
        """Where ``learner``'s exchange of ``message`` at recorded ``step`` runs."""
        m = self.plan.messages[message]
        return Call(m.name, message, step, learner, learners, self.seed, m.shape, m.shapes)

    def reference(self, message: int, mean_grad: torch.Tensor) -> torch.Tensor:
        """The dense update ``message``'s estimate this step should match."""
        momentum = self.memory.momentum
        if not momentum or self.plan.messages[message].dense:
            return mean_grad
        velocity = self._velocity.get(message)
        if velocity is None:
            velocity = self._velocity[message] = mean_grad.clone()
        else:
            velocity.mul_(momentum).add_(mean_grad)
        return velocity

    @property
    def memory_label(self) -> str:
        """The memory that ran, as the records name it."""
        return self.spec.memory.label if self.spec.memory is not None else self.memory.label

    def settings(self) -> dict[str, float | str]:
        """Concrete settings: the parameters (a choice as its word, ``algorithm=ring``),
        and each compressor setting's mean over the objects built (SIDCo's adaptive
        stages differ by learner and message; ``k`` is summed over the messages)."""
        settings: dict[str, float | str] = {
            k: CHOICES[k][int(v)] if k in CHOICES and isinstance(v, float) else v
            for k, v in self.spec.params
        }
        objects = [c for (learner, _), c in self._objects.items() if learner == 0]
        if not objects:
            return settings
        for key in objects[0].settings():
            values = [float(c.settings()[key]) for c in objects]
            settings[key] = sum(values) if key == "k" else sum(values) / len(values)
        return settings


def build_scheme(
    spec: Any,
    ratio: float | None,
    plan: Plan,
    *,
    seed: int = 0,
    reduce: Reduce = sum_in_order,
) -> Scheme:
    """Build ``spec`` at density ``ratio`` (``None`` for fixed-rate compressors) over
    ``plan``. Raises :class:`UsageError` for a rate the compressor cannot honour (a
    sparsifier without a ratio, a ratio outside (0, 1)) or a plan it cannot run on."""
    if spec.fixed_rate:
        ratio = None
    elif ratio is None:
        raise UsageError(f"{spec.label} is a sparsifier: give it a ratio")
    elif not 0.0 < ratio < 1.0 or not math.isfinite(ratio):
        raise UsageError(f"ratio {ratio} is outside (0, 1)")
    spec.entry.check(plan, dict(spec.params))
    try:
        return Scheme(spec, ratio, plan, seed, reduce)
    except ValueError as exc:
        if isinstance(exc, UsageError):
            raise
        raise UsageError(f"{spec.label}: {exc}") from None
