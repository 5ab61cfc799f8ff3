"""Target hardware profiles: the rates a compressor's work is timed with.

The analysis machine is rarely the training machine: ``torch.topk`` on 8M values takes
hundreds of milliseconds on a 2-core CPU and well under a millisecond on a data-centre
GPU. A :class:`Target` holds the few rates the work model
(:mod:`gradstat.compressors.work`) needs:

* ``bandwidth``: effective memory bandwidth (bytes/s) of streaming element-wise kernels;
* ``topk_rate``: input elements per second of a top-k selection, plus
  ``topk_per_selected`` seconds per selected element (writing and, on CPUs, the heap);
* ``sort_rate`` and ``randperm_rate``: elements per second of a key-value sort and of a
  random permutation;
* ``compare_rate``, ``compact_rate``, ``random_rate``: elements per second of a
  comparison to a boolean mask, of a compaction (``nonzero``, ``masked_select``) and of
  uniform random numbers (bandwidth-bound on GPUs, compute-bound on CPUs);
* ``flops`` and ``matmul_bandwidth``: float32 matrix-product rate and the bytes per
  second a thin product ``M Q`` (rank r << columns) reads ``M`` at (PowerSGD); a product
  costs ``max(flops / flops rate, bytes / matmul_bandwidth)``;
* ``launch``: fixed seconds per kernel launch (GPU) or operator call (CPU).

Built-in GPU profiles take the memory bandwidth and float32 rate from the vendor's
datasheet and *derive* the other rates from the bandwidth; ``cpu-here`` and ``gpu-here``
are measured when first used (:func:`measure`); ``--target-file`` reads the same fields
from JSON (:func:`load_target`). docs/replay.md ("Profiles") gives each source.
"""

from __future__ import annotations

import json
import math
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from gradstat.errors import GradstatWarning, UsageError

#: Fraction of the datasheet memory bandwidth streaming kernels reach (assumed).
STREAM_EFFICIENCY = 0.85
#: Bytes a radix-select top-k reads per input element: 4 digit passes + 1 gather pass.
RADIX_SELECT_BYTES = 5 * 4
#: Bytes a 4-pass LSD radix sort of (32-bit key, 32-bit value) moves per element.
RADIX_SORT_BYTES = 4 * 2 * 8
#: Seconds per CUDA kernel launch (assumed; typically 3-10 us end to end).
GPU_LAUNCH = 5e-6
#: Timed calls per measured operation, after WARMUP untimed ones; the median decides.
REPEATS = 9
WARMUP = 2
#: A measured rate whose interquartile range exceeds this fraction of its median is
#: reported as noisy (a busy machine): its recommendation may not repeat.
NOISY_SPREAD = 0.5
#: Bytes allocated and freed once before measuring: with glibc this lifts the dynamic
#: mmap threshold above the measured outputs, so every run times them from the same
#: (heap) allocator state instead of fresh mmap'd, page-faulting memory in some runs.
ALLOCATOR_WARMUP = 16 << 20


@dataclass(frozen=True)
class Target:
    """The rates of one machine (see the module docstring); ``sources`` says where each
    figure comes from."""

    name: str
    description: str
    bandwidth: float
    topk_rate: float
    topk_per_selected: float
    sort_rate: float
    randperm_rate: float
    compare_rate: float
    compact_rate: float
    random_rate: float
    flops: float
    matmul_bandwidth: float
    launch: float
    sources: dict[str, str] = field(default_factory=dict)
    #: Measured profiles: each rate's spread, interquartile range / median of its calls.
    spread: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.type == "float":
                value = getattr(self, f.name)
                positive = value >= 0 if f.name in ("launch", "topk_per_selected") else value > 0
                if not (isinstance(value, (int, float)) and math.isfinite(value) and positive):
                    raise UsageError(
                        f"target {self.name!r}: {f.name} must be positive, got {value}"
                    )

    def to_dict(self) -> dict:
        return asdict(self)


def _gpu(
    name: str, description: str, datasheet_bandwidth: float, fp32: float, sheet: str
) -> Target:
    bandwidth = STREAM_EFFICIENCY * datasheet_bandwidth
    return Target(
        name=name,
        description=description,
        bandwidth=bandwidth,
        topk_rate=bandwidth / RADIX_SELECT_BYTES,
        topk_per_selected=2 * 8 / bandwidth,
        sort_rate=bandwidth / RADIX_SORT_BYTES,
        randperm_rate=bandwidth / RADIX_SORT_BYTES,
        compare_rate=bandwidth / 5,
        compact_rate=bandwidth / 10,
        random_rate=bandwidth / 4,
        flops=fp32,
        matmul_bandwidth=bandwidth,
        launch=GPU_LAUNCH,
        sources={
            "bandwidth": f"{STREAM_EFFICIENCY:g} x {datasheet_bandwidth / 1e9:,.0f} GB/s ({sheet})",
            "flops": f"{fp32 / 1e12:g} TFLOP/s float32, non-tensor-core ({sheet})",
            "topk_rate": f"derived: radix select reads {RADIX_SELECT_BYTES} B per element",
            "sort_rate": f"derived: radix sort moves {RADIX_SORT_BYTES} B per element",
            "randperm_rate": "derived: randperm sorts random keys (as sort_rate)",
            "compare_rate": "derived: reads 4 B, writes 1 B per element",
            "compact_rate": "derived: reads mask and value, scans, writes 4 B (10 B)",
            "random_rate": "derived: writes 4 B per element (Philox is compute-cheap)",
            "matmul_bandwidth": "derived: thin products read M at the streaming bandwidth",
            "launch": f"assumed {GPU_LAUNCH * 1e6:g} us per kernel",
        },
    )


#: name, description, datasheet memory bandwidth (B/s), float32 FLOP/s, the datasheet.
BUILTIN: dict[str, Target] = {
    row[0]: _gpu(*row)
    for row in (
        ("v100", "NVIDIA V100 SXM2 (HBM2)", 900e9, 15.7e12, "NVIDIA Tesla V100 datasheet"),
        ("a100", "NVIDIA A100 SXM 80GB (HBM2e)", 2039e9, 19.5e12, "NVIDIA A100 datasheet"),
        ("h100", "NVIDIA H100 SXM5 80GB (HBM3)", 3.35e12, 67e12, "NVIDIA H100 datasheet"),
        ("h200", "NVIDIA H200 SXM 141GB (HBM3e)", 4.8e12, 67e12, "NVIDIA H200 datasheet"),
    )
}
TARGET_NAMES = ("cpu-here", "gpu-here", *BUILTIN)


@dataclass(frozen=True)
class Timing:
    """Seconds of one operation: the ``median`` of the timed calls and their ``spread``
    (interquartile range / median)."""

    median: float
    spread: float


def _summarize(times: list[float]) -> Timing:
    median = max(statistics.median(times), 1e-9)
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return Timing(median, (q3 - q1) / median)


def _cpu_call(run) -> float:
    """Thread CPU time of one call, not wall time: on a shared machine a descheduled
    thread's wall time measures the other jobs (torch runs its operators on the calling
    thread when it has one thread; with more, the figure is the calling thread's share)."""
    start = time.thread_time()
    run()
    return time.thread_time() - start


def _cuda_call(run) -> float:
    """GPU time between two CUDA events around one call (kernels on the current stream)."""
    begin = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    begin.record()
    run()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3


def time_operations(runs: dict, call=_cpu_call, repeats: int = REPEATS) -> dict[str, Timing]:
    """The :class:`Timing` of every operation of ``runs`` (name -> callable): each is
    called :data:`WARMUP` times untimed, then ``repeats`` rounds time one call of every
    operation in turn, so a burst of other work on the machine hits a few calls of each
    operation (which the median discards), not every call of one."""
    for run in runs.values():
        for _ in range(WARMUP):
            run()
    if call is _cuda_call:
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            times[name].append(call(run))
    return {name: _summarize(values) for name, values in times.items()}


def spread_text(target: Target, rate: str) -> str:
    """``" (±12 % over 9 calls)"`` for a measured rate, ``""`` for a stated one."""
    if rate not in target.spread:
        return ""
    return f" (±{50 * target.spread[rate]:.0f} % over {REPEATS} calls)"


def measure(device: torch.device | str = "cpu", numel: int | None = None) -> Target:
    """Measure the rates of ``device`` (a second or two): ``cpu-here`` on the current
    torch thread count, ``gpu-here`` on a CUDA device (``numel`` 2^20 on a CPU, 2^26 on
    a GPU, large enough that a kernel is not just its launch), each rate the median of
    :data:`REPEATS` calls of its operation (:func:`_operations`; each allocates its
    output as the compressors do) with its spread, a warning above :data:`NOISY_SPREAD`.
    Top-k is timed at densities 0.001 and 0.1, solving ``t = d / rate + k * per_selected``.
    """
    device = torch.device(device)
    gpu = device.type == "cuda"
    numel = numel or (1 << 26 if gpu else 1 << 20)
    square, tall_side = (4096, 8192) if gpu else (512, 1024)
    small_k, large_k = numel // 1000, numel // 10
    if not gpu:
        torch.empty(ALLOCATOR_WARMUP, dtype=torch.uint8)  # allocated and freed at once
    operations = _operations(device, numel, (small_k, large_k), square, tall_side)
    timings = time_operations(operations, _cuda_call if gpu else _cpu_call)
    t = {name: timing.median for name, timing in timings.items()}
    t_small, t_large = t["topk_rate"], t["topk_per_selected"]
    per_selected = max((t_large - t_small) / (large_k - small_k), 0.0)
    name, description, how = _origin(device)
    target = Target(
        name=name,
        description=description,
        bandwidth=12 * numel / t["bandwidth"],
        topk_rate=numel / max(t_small - small_k * per_selected, 1e-9),
        topk_per_selected=per_selected,
        sort_rate=(numel // 4) / t["sort_rate"],
        randperm_rate=numel / t["randperm_rate"],
        compare_rate=numel / t["compare_rate"],
        compact_rate=numel / t["compact_rate"],
        random_rate=numel / t["random_rate"],
        flops=2 * square**3 / t["flops"],
        matmul_bandwidth=2 * 4 * tall_side * tall_side / t["matmul_bandwidth"],
        launch=t["launch"] / 100,
        spread={rate: round(timing.spread, 4) for rate, timing in timings.items()},
        sources=_sources(how, numel, square, tall_side),
    )
    _warn_noisy(target)
    return target


def _operations(
    device: torch.device, numel: int, ks: tuple[int, int], square: int, tall_side: int
) -> dict[str, Callable[[], object]]:
    """The operation timed for each rate of :func:`measure`, on random float32 data of
    ``numel`` elements on ``device`` (top-k at the two ``ks``), a ``square`` matrix and a
    ``tall_side`` x ``tall_side`` one with a rank-4 partner; seeded, so runs compare."""
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=device)

    a, b = randn(numel), randn(numel)
    mask = a > 2.05
    m = randn(square, square)
    tall = randn(1, tall_side, tall_side)
    q = randn(tall_side, 4)
    one = torch.ones(1, device=device)
    return {
        "bandwidth": lambda: a + b,
        "topk_rate": lambda: torch.topk(a, ks[0], sorted=False),
        "topk_per_selected": lambda: torch.topk(a, ks[1], sorted=False),
        "sort_rate": lambda: torch.sort(a[: numel // 4]),
        "randperm_rate": lambda: torch.randperm(numel, generator=generator, device=device),
        "compare_rate": lambda: a > 0.5,
        "compact_rate": lambda: torch.nonzero(mask),
        "random_rate": lambda: torch.rand(numel, generator=generator, device=device),
        "flops": lambda: m @ m,
        "matmul_bandwidth": lambda: (tall @ q, tall.transpose(1, 2) @ q),
        "launch": lambda: [torch.add(one, one) for _ in range(100)],
    }


def _origin(device: torch.device) -> tuple[str, str, str]:
    """``(name, description, how measured)`` of a profile measured now on ``device``."""
    if device.type == "cuda":
        name = "gpu-here"
        description = f"this machine's {torch.cuda.get_device_name(device)}"
        how = "measured now with CUDA events"
    else:
        threads = torch.get_num_threads()
        name, description = "cpu-here", f"this machine's CPU, {threads} torch thread(s)"
        how = f"measured now on {threads} torch thread(s)"
    return name, description, how + f", median of {REPEATS} calls"


def _sources(how: str, numel: int, square: int, tall_side: int) -> dict[str, str]:
    """Where each rate of a measured profile comes from, for its ``sources``."""
    return {
        "bandwidth": f"{how}: a + b of {numel:,} float32 (12 B per element)",
        "topk_rate": f"{how}: torch.topk of {numel:,} at densities 0.001 and 0.1",
        "sort_rate": f"{how}: torch.sort of {numel // 4:,} float32",
        "randperm_rate": f"{how}: torch.randperm({numel:,})",
        "compare_rate": f"{how}: a > 0.5 on {numel:,} float32",
        "compact_rate": f"{how}: torch.nonzero of a {numel:,}-element mask",
        "random_rate": f"{how}: torch.rand({numel:,})",
        "flops": f"{how}: {square}x{square} @ {square}x{square} float32",
        "matmul_bandwidth": f"{how}: M Q and M^T Q, M {tall_side}x{tall_side}, Q {tall_side}x4",
        "launch": f"{how}: torch.add on 1-element tensors",
    }


def _warn_noisy(target: Target) -> None:
    noisy = {k: v for k, v in target.spread.items() if v > NOISY_SPREAD}
    if noisy:
        worst = max(noisy, key=noisy.get)
        warnings.warn(
            f"{target.name}: {len(noisy)} measured rate(s) vary by more than "
            f"±{50 * NOISY_SPREAD:.0f} % between calls (worst {worst}"
            f"{spread_text(target, worst)}): the machine is busy, so compression times "
            "and the recommendation may change between runs; pass --target-file with a "
            "profile measured on a quiet machine to fix them",
            GradstatWarning,
            stacklevel=3,
        )


_MEASURED: dict[tuple[str, int], Target] = {}


def builtin_target(name: str) -> Target:
    """A built-in profile by name; ``cpu-here`` is measured once per thread count,
    ``gpu-here`` once on the current CUDA device (a :class:`UsageError` without one)."""
    if name == "gpu-here" and not torch.cuda.is_available():
        raise UsageError("--target gpu-here measures a CUDA GPU, and none is available here")
    if name in ("cpu-here", "gpu-here"):
        gpu = name == "gpu-here"
        key = ("cuda", torch.cuda.current_device()) if gpu else ("cpu", torch.get_num_threads())
        if key not in _MEASURED:
            _MEASURED[key] = measure(torch.device("cuda", key[1]) if gpu else "cpu")
        return _MEASURED[key]
    if name not in BUILTIN:
        raise UsageError(f"--target {name!r}: choose one of {', '.join(TARGET_NAMES)}")
    return BUILTIN[name]


def load_target(path: str | Path) -> Target:
    """A profile from a JSON object with the fields of :class:`Target`, or from a
    ``gradstat recommend --out`` document (its ``target``: the profile it priced with).

    ``name``, ``description``, ``sources`` and ``spread`` are optional; every rate is
    required, in SI units (bytes/s, elements/s, FLOP/s, seconds).
    """
    path = Path(path)
    try:
        document = json.loads(path.read_text())
    except OSError as exc:
        raise UsageError(f"--target-file {path}: cannot read ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"--target-file {path}: not JSON ({exc})") from None
    if isinstance(document, dict) and isinstance(document.get("target"), dict):
        document = document["target"]  # a recommendation: the profile it used
    if not isinstance(document, dict):
        raise UsageError(f"--target-file {path}: expected a JSON object")
    rates = [f.name for f in fields(Target) if f.type == "float"]
    missing = [name for name in rates if name not in document]
    if missing:
        raise UsageError(f"--target-file {path}: missing {', '.join(missing)}")
    known = {f.name for f in fields(Target)}
    unknown = sorted(set(document) - known)
    if unknown:
        raise UsageError(f"--target-file {path}: unknown field {unknown[0]!r}")
    try:
        values = {name: float(document[name]) for name in rates}
    except (TypeError, ValueError):
        raise UsageError(f"--target-file {path}: every rate must be a number") from None
    return Target(
        name=str(document.get("name", path.stem)),
        description=str(document.get("description", f"from {path}")),
        sources={str(k): str(v) for k, v in dict(document.get("sources", {})).items()}
        or {"all": f"user profile {path}"},
        spread={str(k): float(v) for k, v in dict(document.get("spread", {})).items()},
        **values,
    )


def resolve_target(name: str | None, path: str | Path | None) -> Target:
    """``--target NAME`` or ``--target-file PATH`` (not both); default ``cpu-here``."""
    if name and path:
        raise UsageError("give --target or --target-file, not both")
    if path:
        return load_target(path)
    return builtin_target(name or "cpu-here")
