"""Start-up of commands that compute nothing, against the interpreter and torch.

Times, in fresh processes run side by side (round-robin, median of ``--repeats``):
``python -c pass``, ``python -c 'import torch'``, ``gradstat --version``, ``--help``,
``info CAP`` (a small capture each checkout writes) and ``merge --help``, and prints each over
``pass`` and over ``import torch``. ``--before PATH`` times the same commands from another
checkout (``PYTHONPATH=PATH``) in the same rounds and adds a before column. Issue 28's
goals on a quiet 2-core machine: ``--version`` / ``--help`` 0.3 s, ``info`` 0.6 s.

    python benchmarks/startup.py --repeats 7 --before /work/wt/base
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


#: Writes a small capture with a tree's own writer (trees may differ in schema).
WRITE = (
    "import sys, numpy as np; from pathlib import Path;"
    "from gradstat.store import layer_table, write_capture;"
    "g = np.random.default_rng(0).standard_normal((2, 3, 1000)).astype(np.float32);"
    "write_capture(Path(sys.argv[1]), g, layer_table([('w', (1000,))]))"
)


def _commands(capture: Path) -> dict[str, list[str]]:
    gradstat = [sys.executable, "-m", "gradstat"]
    return {
        "python -c pass": [sys.executable, "-c", "pass"],
        "python -c 'import torch'": [sys.executable, "-c", "import torch"],
        "gradstat --version": [*gradstat, "--version"],
        "gradstat --help": [*gradstat, "--help"],
        "gradstat info CAP": [*gradstat, "info", str(capture)],
        "gradstat merge --help": [*gradstat, "merge", "--help"],
    }


def _seconds(argv: list[str], tree: Path, cwd: Path) -> float:
    env = dict(os.environ, PYTHONPATH=str(tree), COLUMNS="80")
    start = time.perf_counter()
    subprocess.run(argv, env=env, cwd=cwd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--before", type=Path, help="another checkout, timed alongside")
    args = parser.parse_args()
    trees = {"now": HERE} | ({"before": args.before.resolve()} if args.before else {})
    with tempfile.TemporaryDirectory() as tmp:
        commands = {}
        for tree_name, tree in trees.items():
            capture = Path(tmp) / f"cap-{tree_name}"
            env = dict(os.environ, PYTHONPATH=str(tree))
            subprocess.run(
                [sys.executable, "-c", WRITE, str(capture)], env=env, cwd=tmp, check=True
            )
            commands[tree_name] = _commands(capture)
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.repeats):
            for label in commands["now"]:
                for tree_name, tree in trees.items():
                    if label.startswith("python") and tree_name != "now":
                        continue  # the interpreter and torch do not depend on the tree
                    argv = commands[tree_name][label]
                    times.setdefault((label, tree_name), []).append(_seconds(argv, tree, tmp))
    median = {key: statistics.median(v) for key, v in times.items()}
    floor, torch_ = median[("python -c pass", "now")], median[("python -c 'import torch'", "now")]
    load = os.getloadavg()[0]
    print(f"median of {args.repeats} fresh processes; load average {load:.1f} at the end")
    header = f"{'command':<26}{'now s':>8}{'/pass':>8}{'/torch':>8}"
    print(header + (f"{'before s':>10}{'before/now':>12}" if args.before else ""))
    for label in commands["now"]:
        now = median[(label, "now")]
        line = f"{label:<26}{now:8.3f}{now / floor:8.2f}{now / torch_:8.2f}"
        before = median.get((label, "before"))
        if before is not None:
            line += f"{before:10.3f}{before / now:12.2f}"
        print(line)


if __name__ == "__main__":
    main()
