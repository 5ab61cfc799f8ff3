#!/usr/bin/env python3
"""docs/img/lowprec.png: the rms error of a low-precision reduce-scatter and all-reduce
over N = 2..16 learners, by algorithm and accumulation, in bf16 and fp8-e4m3
(docs/lowprecision.md).

The learners share a signal: learner i's gradient is ``s + n_i`` with a heavy-tailed
shared ``s`` (a normal scaled by a log-normal factor, as benchmarks/scale.py writes) and
its own normal noise ``n_i`` of the same scale, 2^20 values; N learners are the first N
of 16 (the same data grows). The error is ``sqrt(||x_hat - mean||^2 / ||mean||^2)``
against the exact float64 mean (gradstat.wire.collectives.relative_error).

    python scripts/lowprec_figure.py [--out docs/img/lowprec.png] [--numel 1048576]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from gradstat.plots.style import legend_below, new_figure, save_figure
from gradstat.wire.collectives import all_reduce, reduce_scatter, relative_error

ROOT = Path(__file__).resolve().parent.parent
LEARNERS = range(2, 17)
#: (algorithm, accumulate) -> label and line style
LINES = {
    ("ring", "wire"): ("ring, sums in the wire format", "-", "o"),
    ("ring", "fp32"): ("ring, sums in fp32 (each hop sent in the format)", "--", "s"),
    ("tree", "wire"): ("tree, sums in the wire format", "-.", "^"),
    ("a2a", "fp32"): ("all-to-all + fp32 sum", ":", "D"),
}
FORMATS = ("bf16", "fp8-e4m3")
COLLECTIVES = {
    "reduce-scatter": lambda x, **s: torch.cat(reduce_scatter(x, **s)),
    "all-reduce": all_reduce,
}


def learners_data(numel: int, learners: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randn(numel, generator=g) * torch.exp(0.7 * torch.randn(numel, generator=g))
    return [shared + torch.randn(numel, generator=g) for _ in range(learners)]


def rms_errors(numel: int) -> dict[tuple[str, str, str, str], list[float]]:
    """(collective, format, algorithm, accumulate) -> rms error at each N of LEARNERS."""
    data = learners_data(numel, max(LEARNERS))
    errors: dict[tuple[str, str, str, str], list[float]] = {}
    for name, collective in COLLECTIVES.items():
        for wire in FORMATS:
            for algorithm, accumulate in LINES:
                key = (name, wire, algorithm, accumulate)
                for n in LEARNERS:
                    inputs = torch.stack(data[:n])
                    total = collective(
                        inputs, wire=wire, algorithm=algorithm, accumulate=accumulate
                    )
                    errors.setdefault(key, []).append(math.sqrt(relative_error(total, inputs)))
    return errors


def figure(errors: dict, out: Path) -> Path:
    fig, axes = new_figure(len(COLLECTIVES), len(FORMATS), width=4.2, height=3.0)
    xs = list(LEARNERS)
    for row, name in zip(axes, COLLECTIVES, strict=True):
        for ax, wire in zip(row, FORMATS, strict=True):
            for (algorithm, accumulate), (label, style, marker) in LINES.items():
                values = errors[(name, wire, algorithm, accumulate)]
                ax.plot(xs, values, linestyle=style, marker=marker, markersize=3, label=label)
            ring = errors[(name, wire, "ring", "wire")]
            guide = [ring[-1] * math.sqrt(n / xs[-1]) for n in xs]
            ax.plot(xs, guide, color="0.6", linewidth=0.8, label="proportional to sqrt(N)")
            ax.set_yscale("log")  # labels at 1, 2, 3, 4, 5 x 10^k, as plain numbers
            ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 3.0, 4.0, 5.0)))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
            ax.set_xticks([2, 4, 8, 12, 16])
            ax.set_title(f"{name}, {wire} on the wire")
            ax.set_xlabel("learners N")
        row[0].set_ylabel("rms error of the mean (relative)")
    legend_below(fig, ncols=2)
    return save_figure(fig, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "lowprec.png")
    parser.add_argument("--numel", type=int, default=1 << 20)
    args = parser.parse_args()
    errors = rms_errors(args.numel)
    for key, values in errors.items():
        print(" ".join(key), " ".join(f"{v:.2e}" for v in values))
    print(figure(errors, args.out))


if __name__ == "__main__":
    main()
