"""``gradstat recommend`` against one top-k replay, side by side on a large capture.

Writes a synthetic schema-1 capture shaped like GPT-2 small's transformer blocks (per
block: attention in and out, MLP in and out, their biases and two layer norms; 12
blocks of width 768 are 85M values), ``--learners`` learners and ``--steps`` steps, row
by row (a heavy-tailed shared signal, normal scaled by a log-normal factor, plus each
learner's normal noise; one row in memory at a time), then times in turn, ``--repeats``
times each, two commands on it in fresh processes:

* ``replay``: ``gradstat replay CAP --compressors topk --ratios 0.01``;
* ``recommend``: ``gradstat recommend CAP --error-budget B`` with its default
  candidates (every built-in but ``none`` and ``redsync-sidco``, each sparsifier at
  0.1, 0.01 and 0.001).

Both run with ``--jobs 1`` and the default thread policy and memory budget, alternately.
Printed: each command's fastest wall time (the machine is shared: the fastest of a few is
the least disturbed), its least CPU time (user + system of the child and its threads,
which other jobs disturb less), its largest peak resident memory (``ru_maxrss`` of the
child, via ``wait4``), and recommend / replay in both (target of issue 39: <= 3). The
capture goes under ``--dir`` (default ``$TMPDIR``) and is deleted at the end (``--capture
PATH`` times an existing one instead); it takes learners x steps x numel x 4 bytes (85M x
4 x 3: 4.1 GB).

    python benchmarks/recommend_scale.py --width 768 --blocks 12 --learners 4 --steps 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scale import write_synthetic  # benchmarks/scale.py, beside this script

from gradstat.store import layer_table

ROOT = Path(__file__).resolve().parent.parent


def gpt2_layers(width: int, blocks: int) -> list[tuple[str, tuple[int, ...]]]:
    """GPT-2's transformer blocks (no embeddings): ``blocks`` x 12 width^2 + 13 width values."""
    named = []
    for b in range(blocks):
        p = f"h.{b}."
        named += [
            (p + "ln_1.weight", (width,)),
            (p + "ln_1.bias", (width,)),
            (p + "attn.c_attn.weight", (width, 3 * width)),
            (p + "attn.c_attn.bias", (3 * width,)),
            (p + "attn.c_proj.weight", (width, width)),
            (p + "attn.c_proj.bias", (width,)),
            (p + "ln_2.weight", (width,)),
            (p + "ln_2.bias", (width,)),
            (p + "mlp.c_fc.weight", (width, 4 * width)),
            (p + "mlp.c_fc.bias", (4 * width,)),
            (p + "mlp.c_proj.weight", (4 * width, width)),
            (p + "mlp.c_proj.bias", (width,)),
        ]
    return named


def write_gpt2(folder: Path, width: int, blocks: int, learners: int, steps: int) -> int:
    """Write the capture (:func:`scale.write_synthetic`'s rows); returns its values per
    learner and step."""
    layers = layer_table(gpt2_layers(width, blocks))
    numel = layers[-1].stop
    write_synthetic(folder, numel, learners, steps, layers=layers)
    return numel


def timed(command: list[str]) -> tuple[float, float, int, str]:
    """(wall seconds, CPU seconds, peak RSS bytes, stderr) of ``command`` in a fresh
    process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "100"}
    with tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, env=env)
        _, status, usage = os.wait4(child.pid, 0)
        seconds = time.perf_counter() - start
        err.seek(0)
        text = err.read()
    if os.waitstatus_to_exitcode(status):
        raise RuntimeError(f"{' '.join(command)} failed:\n{text}")
    return seconds, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024, text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--error-budget", type=float, default=0.5)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--keep", action="store_true", help="keep the capture")
    parser.add_argument("--capture", type=Path, help="time on this capture (kept) instead")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="recommend-scale-", dir=args.dir))
    gradstat = [sys.executable, "-m", "gradstat"]
    try:
        cap = args.capture or folder / "capture"
        if args.capture is None:
            numel = write_gpt2(cap, args.width, args.blocks, args.learners, args.steps)
        else:
            numel = 12 * args.width**2 * args.blocks + 13 * args.width * args.blocks
        print(f"capture: {numel / 1e6:.1f}M values x {args.learners} learners x {args.steps} steps")
        commands = {
            "replay": [*gradstat, "replay", str(cap), "--compressors", "topk", "--ratios", "0.01"],
            "recommend": [
                *gradstat,
                "recommend",
                str(cap),
                "--error-budget",
                str(args.error_budget),
            ],
        }
        best: dict[str, tuple[float, float, int]] = {}  # fastest wall, least CPU, largest RSS
        for _ in range(args.repeats):
            for name, command in commands.items():
                seconds, cpu, peak, err = timed([*command, "--jobs", "1"])
                old = best.get(name, (seconds, cpu, peak))
                best[name] = (min(old[0], seconds), min(old[1], cpu), max(old[2], peak))
                print(f"  {name}: {seconds:.1f} s, {cpu:.1f} s CPU, peak RSS {peak / 1e9:.2f} GB")
                if name == "recommend":
                    print("    " + "\n    ".join(err.strip().splitlines()), flush=True)
        print(f"{'command':<10} {'fastest s':>10} {'least CPU s':>12} {'peak GB':>8}")
        for name, (seconds, cpu, peak) in best.items():
            print(f"{name:<10} {seconds:>10.1f} {cpu:>12.1f} {peak / 1e9:>8.2f}")
        wall = best["recommend"][0] / best["replay"][0]
        cpu = best["recommend"][1] / best["replay"][1]
        print(f"recommend / replay: {wall:.2f} wall, {cpu:.2f} CPU (target <= 3)")
    finally:
        if args.keep:
            print(f"kept {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
