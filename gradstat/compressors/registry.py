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
from dataclasses import dataclass, field

import torch

from gradstat.compressors.estimated import EstimatedSparsifier
from gradstat.compressors.legacy import Compressor, Exchange
from gradstat.compressors.memory import DGCMemory, Memory, NoMemory, ResidualMemory
from gradstat.compressors.powersgd import PowerSGD
from gradstat.compressors.quantize import QSGD, Cast, NoCompression, SignSGD, TernGrad
from gradstat.compressors.sparse import CLTK, GTopK, RandomK, TopK
from gradstat.errors import UsageError
from gradstat.stats.sidco import STAGE_FITS, ZEROS

#: Parameters that take a word: their choices, stored by index (the default is index 0).
CHOICES: dict[str, tuple[str, ...]] = {"zeros": ZEROS, "stage_fit": STAGE_FITS}


@dataclass(frozen=True)
class Context:
    """What a compressor is built for: its rate, the scope's size and parameter shapes."""

    ratio: float | None
    k: int | None
    numel: int
    shapes: tuple[tuple[int, ...], ...]
    params: Mapping[str, float]
    seed: int


def _estimated(estimator: str) -> Callable[[Context], Compressor]:
    def build(ctx: Context) -> Compressor:
        name = estimator if estimator != "hard" else "threshold"
        assert ctx.ratio is not None and ctx.k is not None
        threshold = ctx.params.get("threshold") or None
        return EstimatedSparsifier(
            name,
            ctx.ratio,
            ctx.k,
            ctx.numel,
            estimator,
            stages=int(ctx.params.get("stages", 0)),
            threshold=threshold,
            zeros=ZEROS[int(ctx.params.get("zeros", 0))],
            stage_fit=STAGE_FITS[int(ctx.params.get("stage_fit", 0))],
            seed=ctx.seed,
        )

    return build


def _powersgd(ctx: Context) -> Compressor:
    compressor = PowerSGD(ctx.shapes, rank=int(ctx.params["rank"]), seed=ctx.seed)
    if not compressor.matrices:
        raise UsageError(
            f"powersgd at rank {int(ctx.params['rank'])} compresses no parameter of this "
            "scope (needs a matrix with (rows + cols) * rank < rows * cols / 2)"
        )
    return compressor


@dataclass(frozen=True)
class Entry:
    """One registered compressor: how to build it and its memory, and its parameters."""

    build: Callable[[Context], Compressor]
    memory: Callable[[Mapping[str, float]], Memory]
    fixed_rate: bool
    summary: str
    params: Mapping[str, float] = field(default_factory=dict)
    #: Among ``recommend``'s default candidates (reference behaviours run on request).
    candidate: bool = True


def _residual(params: Mapping[str, float]) -> Memory:
    return ResidualMemory(beta=params.get("beta", 1.0))


def _none(params: Mapping[str, float]) -> Memory:
    return NoMemory()


def _dgc(params: Mapping[str, float]) -> Memory:
    return DGCMemory(momentum=params["momentum"])


_SIDCO = {"stages": 0.0, "zeros": 0.0, "stage_fit": 0.0}
REGISTRY: dict[str, Entry] = {
    "none": Entry(
        lambda ctx: NoCompression(), _none, True, "dense float32 all-reduce", candidate=False
    ),
    "fp16": Entry(lambda ctx: Cast(torch.float16), _none, True, "float16 cast, all-reduce"),
    "bf16": Entry(lambda ctx: Cast(torch.bfloat16), _none, True, "bfloat16 cast, all-reduce"),
    "topk": Entry(lambda ctx: TopK(ctx.k), _residual, False, "exact top-k, all-gather"),
    "randomk": Entry(
        lambda ctx: RandomK(ctx.k, seed=ctx.seed),
        _residual,
        False,
        "random-k with a shared seed, all-reduce of values",
    ),
    "threshold": Entry(
        _estimated("hard"),
        _residual,
        False,
        "fixed hard threshold (calibrated on the first step unless threshold= is given)",
        {"threshold": 0.0},
    ),
    "dgc": Entry(
        _estimated("dgc"),
        _dgc,
        False,
        "DGC sampled threshold with momentum correction and factor masking",
        {"momentum": 0.9},
    ),
    "gaussiank": Entry(_estimated("gaussiank"), _residual, False, "Gaussian-k threshold"),
    "redsync": Entry(_estimated("redsync"), _residual, False, "RedSync binary-search threshold"),
    "redsync-sidco": Entry(
        _estimated("redsync-sidco"),
        _residual,
        False,
        "RedSync as the SIDCo reference (3 probes)",
        candidate=False,
    ),
    "sidco-exp": Entry(_estimated("sidco-exp"), _residual, False, "SIDCo-E (exponential)", _SIDCO),
    "sidco-gpd": Entry(_estimated("sidco-gpd"), _residual, False, "SIDCo-P (GPD)", _SIDCO),
    "sidco-gamma-gpd": Entry(
        _estimated("sidco-gamma-gpd"), _residual, False, "SIDCo-GP (gamma, then GPD)", _SIDCO
    ),
    "clt-k": Entry(
        lambda ctx: CLTK(ctx.k, beta=ctx.params["beta"]),
        _residual,
        False,
        "ScaleCom cyclic local top-k with low-pass memory",
        {"beta": 1.0},
    ),
    "gtopk": Entry(lambda ctx: GTopK(ctx.k), _residual, False, "global top-k by tree merge"),
    "powersgd": Entry(_powersgd, _residual, True, "PowerSGD rank-r, warm-started", {"rank": 4}),
    "signsgd": Entry(lambda ctx: SignSGD(majority=True), _none, True, "signSGD with majority vote"),
    "ef-signsgd": Entry(
        lambda ctx: SignSGD(majority=False), _residual, True, "scaled sign with error feedback"
    ),
    "qsgd": Entry(
        lambda ctx: QSGD(int(ctx.params["levels"]), int(ctx.params["bucket"]), seed=ctx.seed),
        _none,
        True,
        "QSGD stochastic levels per bucket",
        {"levels": 127, "bucket": 512},
    ),
    "terngrad": Entry(lambda ctx: TernGrad(seed=ctx.seed), _none, True, "TernGrad ternary"),
}


@dataclass(frozen=True)
class CompressorSpec:
    """A compressor name with its parameters (registry defaults filled in)."""

    name: str
    params: tuple[tuple[str, float], ...] = ()

    @property
    def entry(self) -> Entry:
        return REGISTRY[self.name]

    @property
    def fixed_rate(self) -> bool:
        return self.entry.fixed_rate

    @property
    def label(self) -> str:
        """``name`` plus the parameters that differ from the defaults."""
        changed = [
            f"{key}={CHOICES[key][int(value)] if key in CHOICES else format(value, 'g')}"
            for key, value in self.params
            if value != self.entry.params[key]
        ]
        return ":".join([self.name, *changed])


def parse_compressors(
    spec: str | Sequence[str], defaults: Mapping[str, float] | None = None
) -> list[CompressorSpec]:
    """Parse ``topk,clt-k:beta=0.1,powersgd:rank=2`` (or a list of such names).

    ``defaults`` overrides registry defaults for every compressor that has the parameter
    (e.g. ``--rank`` and ``--beta``), unless the name sets it itself.
    """
    parts = [p.strip() for p in spec.split(",")] if isinstance(spec, str) else list(spec)
    parts = [p for p in parts if p]
    if not parts:
        raise UsageError("give at least one compressor")
    specs = []
    for part in parts:
        name, *assignments = part.split(":")
        if name not in REGISTRY:
            from gradstat.compressors.spec import is_user_spec, user_spec

            if is_user_spec(part, REGISTRY):  # MODULE:CLASS, FILE.py:CLASS, entry point
                specs.append(user_spec(part))
                continue
            raise UsageError(
                f"unknown compressor {name!r}; known: {', '.join(sorted(REGISTRY))}, "
                "or your own as MODULE:CLASS or FILE.py:CLASS (docs/compressors.md)"
            )
        allowed = REGISTRY[name].params
        params = {k: v for k, v in (defaults or {}).items() if k in allowed}
        for assignment in assignments:
            key, _, value = assignment.partition("=")
            if key not in allowed:
                known = ", ".join(allowed) or "none"
                raise UsageError(f"{part!r}: {name} has no parameter {key!r} (known: {known})")
            if key in CHOICES:
                if value not in CHOICES[key]:
                    choices = ", ".join(CHOICES[key])
                    raise UsageError(f"{part!r}: {key} must be one of {choices}, got {value!r}")
                params[key] = float(CHOICES[key].index(value))
                continue
            try:
                params[key] = float(value)
            except ValueError:
                raise UsageError(f"{part!r}: {key} must be a number, got {value!r}") from None
        filled = tuple((key, float(params.get(key, default))) for key, default in allowed.items())
        specs.append(CompressorSpec(name, filled))
    labels = [s.label for s in specs]
    duplicated = sorted({label for label in labels if labels.count(label) > 1})
    if duplicated:
        raise UsageError(f"compressor {duplicated[0]!r} is named twice")
    return specs


class Scheme:
    """A compressor and its error-feedback memory replayed together over steps.

    ``reference`` is the dense update the estimate is judged against: the mean gradient,
    or for DGC the dense momentum update ``u = mu u + mean(g)`` that momentum correction
    stands in for (Lin et al. 2018, section 3.2).
    """

    def __init__(
        self, spec: CompressorSpec, ratio: float | None, compressor: Compressor, memory: Memory
    ) -> None:
        self.spec = spec
        self.ratio = ratio
        self.compressor = compressor
        self.memory = memory
        self.momentum = memory.momentum if isinstance(memory, DGCMemory) else 0.0
        self._velocity: torch.Tensor | None = None

    def step(self, grads: torch.Tensor) -> Exchange:
        """Compensate, compress and aggregate, then update memory: one step of all learners."""
        corrected = self.memory.compensate(grads)
        exchange = self.compressor.exchange(corrected)
        self.memory.update(corrected, exchange.sent)
        return exchange

    def reference(self, mean_grad: torch.Tensor) -> torch.Tensor:
        """The dense update this step's estimate should match."""
        if not self.momentum:
            return mean_grad
        if self._velocity is None:
            self._velocity = mean_grad.clone()
        else:
            self._velocity.mul_(self.momentum).add_(mean_grad)
        return self._velocity

    def settings(self) -> dict[str, float]:
        """Concrete settings: the compressor's, plus its parameters."""
        return {**dict(self.spec.params), **self.compressor.settings()}


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
    ctx = Context(ratio, k, numel, tuple(tuple(s) for s in shapes), params, seed)
    try:
        compressor = spec.entry.build(ctx)
        memory = spec.entry.memory(params)
    except ValueError as exc:
        if isinstance(exc, UsageError):
            raise
        raise UsageError(f"{spec.label}: {exc}") from None
    return Scheme(spec, ratio, compressor, memory)
