"""The compressor registry: names, parameters, rates and their error-feedback memories.

A compressor is named on the command line as ``NAME[:PARAM=VALUE[:PARAM=VALUE]]``, e.g.
``clt-k:beta=0.1``, ``powersgd:rank=2`` or ``sidco-gpd:stages=3:stage_fit=mle:zeros=include``
(a choice parameter is stored as the index of its word in :data:`CHOICES`). Sparsifiers
take their density from ``--ratios``; fixed-rate compressors (casts, sign, QSGD,
TernGrad, PowerSGD) ignore it and are replayed once. :func:`build_scheme` pairs a
compressor with its memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from importlib import import_module
from typing import Any

import torch

from gradstat.compressors.base import Compressor
from gradstat.compressors.exchange import StepOutcome, Stream
from gradstat.compressors.memory import DGCMemory, Memory, NoMemory, ResidualMemory, TensorRows
from gradstat.errors import UsageError
from gradstat.stats.sidco import STAGE_FITS, ZEROS

#: Parameters that take a word: their choices, stored by index (the default is index 0).
CHOICES: dict[str, tuple[str, ...]] = {"zeros": ZEROS, "stage_fit": STAGE_FITS}


@dataclass(frozen=True)
class Context:
    """What a compressor is built for, once per learner: its rate, the scope's size and
    parameter shapes, its parameters, the scheme's ``seed`` and the ``learner``."""

    ratio: float | None
    k: int | None
    numel: int
    shapes: tuple[tuple[int, ...], ...]
    params: Mapping[str, float]
    seed: int
    learner: int = 0
    #: state the learners of one replayed scheme share (a calibrated threshold; in
    #: training each learner has its own and the compressor's ``online`` agrees on it)
    shared: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def own_seed(self) -> int:
        """The seed of a random stream of this learner's own (QSGD's levels, DGC's
        sample): ``seed + 7919 learner``; a draw all learners share uses ``seed``."""
        return self.seed + 7919 * self.learner


@dataclass(frozen=True)
class Entry:
    """One registered compressor: how to build it (once per learner), whether its rate is
    fixed (it ignores ``--ratios``), and its parameters with their defaults. ``build``:
    a function of the :class:`Context`, or ``"MODULE[:FUNCTION]"`` naming one in
    ``gradstat.compressors`` (``FUNCTION`` defaults to ``build``), imported on first use."""

    build: Callable[[Context], Compressor] | str
    fixed_rate: bool
    summary: str
    params: Mapping[str, float] = field(default_factory=dict)
    #: Among ``recommend``'s default candidates (reference behaviours run on request).
    candidate: bool = True
    #: The collectives ``:collective=`` may choose (the first is the default); empty for a
    #: compressor with an exchange of its own (CLT-k's broadcast, gTop-k's tree).
    collectives: tuple[str, ...] = ("allgather",)

    def make(self, context: Context) -> Compressor:
        """One learner's compressor object."""
        if callable(self.build):
            return self.build(context)
        module, _, function = self.build.partition(":")
        home = import_module(f"gradstat.compressors.{module}")
        return getattr(home, function or "build")(context)


_SIDCO = {"stages": 0.0, "zeros": 0.0, "stage_fit": 0.0}
#: Payloads that add up element-wise: all-reduced by default, all-gathered on request.
_SUMS = ("allreduce", "allgather")
#: Every built-in compressor: one module each, one line here.
REGISTRY: dict[str, Entry] = {
    "none": Entry("none", True, "dense float32 all-reduce", candidate=False, collectives=_SUMS),
    "fp16": Entry("cast:build_fp16", True, "float16 cast, all-reduce", collectives=_SUMS),
    "bf16": Entry("cast:build_bf16", True, "bfloat16 cast, all-reduce", collectives=_SUMS),
    "topk": Entry("topk", False, "exact top-k, all-gather"),
    "randomk": Entry(
        "randomk", False, "random-k with a shared seed, all-reduce of values", collectives=()
    ),
    "threshold": Entry(
        "estimated:build_threshold",
        False,
        "fixed hard threshold (calibrated on the first step unless threshold= is given)",
        {"threshold": 0.0},
    ),
    "dgc": Entry(
        "estimated:build_dgc",
        False,
        "DGC sampled threshold with momentum correction and factor masking",
        {"momentum": 0.9},
    ),
    "gaussiank": Entry("estimated:build_gaussiank", False, "Gaussian-k threshold"),
    "redsync": Entry("estimated:build_redsync", False, "RedSync binary-search threshold"),
    "redsync-sidco": Entry(
        "estimated:build_redsync_sidco",
        False,
        "RedSync as the SIDCo reference (3 probes)",
        candidate=False,
    ),
    "sidco-exp": Entry("estimated:build_sidco_exp", False, "SIDCo-E (exponential)", _SIDCO),
    "sidco-gpd": Entry("estimated:build_sidco_gpd", False, "SIDCo-P (GPD)", _SIDCO),
    "sidco-gamma-gpd": Entry(
        "estimated:build_sidco_gamma_gpd", False, "SIDCo-GP (gamma, then GPD)", _SIDCO
    ),
    "clt-k": Entry(
        "cltk",
        False,
        "ScaleCom cyclic local top-k with low-pass memory",
        {"beta": 1.0},
        collectives=(),
    ),
    "gtopk": Entry("gtopk", False, "global top-k by tree merge", collectives=()),
    "powersgd": Entry(
        "powersgd", True, "PowerSGD rank-r, warm-started", {"rank": 4}, collectives=()
    ),
    "signsgd": Entry("signsgd:build_majority", True, "signSGD with majority vote"),
    "ef-signsgd": Entry("signsgd:build_ef", True, "scaled sign with error feedback"),
    "qsgd": Entry(
        "qsgd", True, "QSGD stochastic levels per bucket", {"levels": 127, "bucket": 512}
    ),
    "terngrad": Entry("terngrad", True, "TernGrad ternary"),
}


@dataclass(frozen=True)
class CompressorSpec:
    """A compressor name with its parameters (registry defaults filled in); ``custom``:
    the entry of a compressor that is not a built-in (a user's class), else None;
    ``memory``: the error-feedback memory named after ``+`` (a
    :class:`~gradstat.compressors.spec.MemorySpec`; None: the compressor's own default);
    ``collective``: ``allgather`` or ``allreduce`` given as ``:collective=``, else None."""

    name: str
    params: tuple[tuple[str, float], ...] = ()
    custom: Entry | None = None
    memory: Any = None
    collective: str | None = None

    @property
    def entry(self) -> Entry:
        return self.custom or REGISTRY[self.name]

    @property
    def fixed_rate(self) -> bool:
        return self.entry.fixed_rate

    @property
    def base_label(self) -> str:
        """``name`` plus the parameters that differ from the defaults."""
        changed = [
            f"{key}={CHOICES[key][int(value)] if key in CHOICES else format(value, 'g')}"
            for key, value in self.params
            if value != self.entry.params[key]
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


def builtin_memory(name: str, params: Mapping[str, float]) -> Memory:
    """A fresh built-in memory ``none``, ``residual`` or ``dgc`` with ``params``."""
    if name == "residual":
        return ResidualMemory(beta=params.get("beta", 1.0))
    if name == "dgc":
        return DGCMemory(momentum=params.get("momentum", 0.9))
    return NoMemory()


def scheme_memory(spec: CompressorSpec, compressor: Compressor) -> Memory:
    """The memory of ``spec``'s scheme: the one named after ``+``, else the compressor's."""
    if spec.memory is None:
        return compressor.memory()
    if spec.memory.builtin:
        return builtin_memory(spec.memory.name, dict(spec.memory.params))
    own = getattr(compressor, "memory", None)
    if not getattr(compressor, "own_memory", False):
        raise UsageError(f"{spec.label}: a memory of your own runs with a class of your own")
    return own()


class Scheme:
    """A compressor and its error-feedback memory replayed together over steps.

    Every learner has its own compressor object (:meth:`for_learner`, built on first
    use), as in training; ``compressor`` is learner 0's and ``memory`` serves them all.
    ``reference`` is the dense update the estimate is judged against: the mean gradient,
    or for DGC the dense momentum update ``u = mu u + mean(g)`` that momentum correction
    stands in for (Lin et al. 2018, section 3.2).
    """

    def __init__(self, spec: CompressorSpec, ratio: float | None, context: Context) -> None:
        self.spec = spec
        self.ratio = ratio
        self.context = context
        self._learners: dict[int, Compressor] = {}
        self.compressor = self.for_learner(0)
        self.memory = scheme_memory(spec, self.compressor)
        self._velocity: torch.Tensor | None = None
        self._stream: Stream | None = None

    def for_learner(self, learner: int) -> Compressor:
        """Learner ``learner``'s compressor object."""
        if learner not in self._learners:
            context = replace(self.context, learner=learner)
            made = self.spec.entry.make(context)
            if self.spec.collective is not None:
                made.collective = self.spec.collective
            self._learners[learner] = made
        return self._learners[learner]

    def step(self, grads: torch.Tensor, name: str = "model") -> StepOutcome:
        """One step of every learner's rows ``grads[n, d]`` held in memory (benchmarks,
        tests): the replay's stream fed the rows in order, the memory in RAM."""
        n, d = grads.shape
        if self._stream is None:
            self.memory.allocate(n, d, TensorRows)
            self._stream = self.compressor.stream(self, name, n, d)
        self._stream.begin(lambda i: grads[i])
        for i in range(n):
            self._stream.learner(i, grads[i])
        return self._stream.finish()

    def reference(self, mean_grad: torch.Tensor) -> torch.Tensor:
        """The dense update this step's estimate should match."""
        momentum = self.memory.momentum
        if not momentum:
            return mean_grad
        if self._velocity is None:
            self._velocity = mean_grad.clone()
        else:
            self._velocity.mul_(momentum).add_(mean_grad)
        return self._velocity

    def settings(self) -> dict[str, float]:
        """Concrete settings: the parameters, and each compressor setting's mean over the
        learners built (SIDCo's adaptive stages differ by learner)."""
        settings = dict(self.spec.params)
        objects = list(self._learners.values())
        for key in objects[0].settings():
            values = [float(c.settings()[key]) for c in objects]
            settings[key] = sum(values) / len(values)
        return settings


def build_scheme(
    spec: CompressorSpec,
    ratio: float | None,
    k: int | None,
    *,
    numel: int,
    shapes: Sequence[tuple[int, ...]] = (),
    seed: int = 0,
) -> Scheme:
    """Build ``spec`` at density ``ratio`` keeping ``k`` elements (both ``None`` for
    fixed-rate compressors) for a scope of ``numel`` elements.

    Raises :class:`UsageError` for a rate the compressor cannot honour: a sparsifier
    without a ratio, or a ratio that keeps less than one element.
    """
    params = dict(spec.params)
    if spec.fixed_rate:
        ratio = k = None
    else:
        if ratio is None or k is None:
            raise UsageError(f"{spec.label} is a sparsifier: give it a ratio")
        if not 0.0 < ratio < 1.0 or not math.isfinite(ratio):
            raise UsageError(f"ratio {ratio} is outside (0, 1)")
        if ratio * numel < 1:
            raise UsageError(
                f"{spec.label} cannot honour ratio {ratio:g} on {numel:,} elements "
                f"(it keeps less than one element; the smallest density is {1 / numel:.3g})"
            )
    context = Context(ratio, k, numel, tuple(tuple(s) for s in shapes), params, seed)
    try:
        return Scheme(spec, ratio, context)
    except ValueError as exc:
        if isinstance(exc, UsageError):
            raise
        raise UsageError(f"{spec.label}: {exc}") from None
