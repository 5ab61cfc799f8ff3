"""Issue 30's and 40's fuzz run at full size: damaged and hostile copies of captures
through the library and the command line, issue 40's command-line fault families, and
the table of outcomes (cases x outcome).

Three small captures are damaged (tests/fuzz_cases.py: truncations, bit flips in rows,
in rank-file metadata and in capture.h5, zeroed pages, edited attributes and tables,
swapped, missing and foreign rank files): one closed cleanly, one whose writers were
killed (rank files flagged "open for write", read in SWMR mode) and one with /sent rows.
Every case is read through the library in a forked child (every row, every /sent row);
every ``--cli-every``-th case also through ``gradstat info --verify`` and ``gradstat
similarity`` in fresh processes. Outcomes: ``error`` (exit 1 or 2 and one ``Error:``
line naming a file of the capture), ``same`` (the undamaged answer), ``silent wrong``,
``unnamed error``, ``crash`` (a traceback, or in the library an exception that is no
gradstat error), ``unexpected`` (an ``Error: unexpected ...`` line), ``hang`` (no answer
within ``--timeout``), ``signal``. Then issue 40's families (tests/fuzz_scenarios.py:
a capture naming code, signals mid-run with scratch and ``--jobs``, outputs onto a full
disk, backtracking ``--scope`` patterns, control characters and formula cells), whose
outcomes add ``code ran`` and ``left behind`` (scratch, a partial file, a process).

    python benchmarks/fuzz_captures.py --per-kind 12 --cli-every 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.fuzz_cases import OK, digest, make_cases, outcome  # noqa: E402
from tests.fuzz_scenarios import FAMILIES  # noqa: E402

OUTCOMES = (
    "error",
    "same",
    "silent wrong",
    "unnamed error",
    "crash",
    "unexpected",
    "hang",
    "signal",
    "code ran",
    "left behind",
)


def _captures(folder: Path) -> dict[str, tuple[Path, Path | None]]:
    """name -> (capture, a foreign capture of the same layout or None)."""
    from tests.test_cli_faults import _killed_capture
    from tests.test_fuzz import _capture
    from tests.test_integrity import _sent_capture

    closed, foreign = _capture(folder / "closed", 0), _capture(folder / "foreign", 1)
    sent, _, _ = _sent_capture(folder / "sent", steps=3, numel=300_000)
    return {
        "closed": (closed, foreign),
        "killed": (_killed_capture(folder / "killed"), None),
        "sent": (sent, None),
    }


#: What ``info --json`` says about the data (the rest describes the files themselves).
INFO_KEYS = ("steps", "layers", "numel", "recorded_ranks", "world_size", "dtype", "loss")


def answer(command: str, stdout: str, path: Path) -> str:
    """The part of a command's JSON output that a damaged file must not change."""
    if command == "info":
        try:
            doc = json.loads(stdout)
        except ValueError:
            return stdout
        return json.dumps({key: doc.get(key) for key in INFO_KEYS}, sort_keys=True)
    return stdout.replace(str(path), "CAPTURE")


def cli_outcome(path: Path, argv: list[str], expected: str, timeout: float) -> str:
    """The outcome of ``gradstat ARGV PATH`` (see the module docstring)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GRADSTAT_OPEN_TIMEOUT": "5"}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "gradstat", *argv[:1], str(path), *argv[1:]],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd="/",
            check=False,
        )
    except subprocess.TimeoutExpired:
        return "hang"
    if done.returncode < 0:
        return "signal"
    if "Traceback" in done.stderr:
        return "crash"
    if done.returncode == 0:
        return "same" if answer(argv[0], done.stdout, path) == expected else "silent wrong"
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    if any(line.startswith("Error: unexpected ") for line in errors):
        return "unexpected"
    named = len(errors) == 1 and str(path) in errors[0]
    return "error" if named and done.returncode in (1, 2) else "unnamed error"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-kind", type=int, default=12, help="random cases of each kind")
    parser.add_argument("--cli-every", type=int, default=4, help="0: library only")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument(
        "--families", choices=("all", "only", "none"), default="all",
        help="issue 40's command-line families: with the damaged copies, alone, or not",
    )  # fmt: skip
    parser.add_argument(
        "--family", action="append", default=None,
        help="run only this family of issue 40 (code, signals, full disk, patterns, text)",
    )  # fmt: skip
    args = parser.parse_args()
    os.environ["GRADSTAT_OPEN_TIMEOUT"] = "5"
    commands = [["info", "--verify", "--json"], ["similarity", "--json", "--ratios", "0.01"]]
    table: Counter = Counter()
    failures = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        folder = Path(tmp)
        copies = {} if args.families == "only" else _captures(folder)
        for name, (base, foreign) in copies.items():
            expected = digest(base)
            cli_expected = {}
            for argv in commands:
                done = subprocess.run(
                    [sys.executable, "-m", "gradstat", argv[0], str(base), *argv[1:]],
                    capture_output=True,
                    text=True,
                    env={**os.environ, "PYTHONPATH": str(ROOT)},
                    cwd="/",
                    check=False,
                )
                cli_expected[argv[0]] = answer(argv[0], done.stdout, base)
            rng = np.random.default_rng([args.seed, len(name)])
            cases = make_cases(base, foreign, rng, args.per_kind)
            for i, case in enumerate(cases):
                if name == "killed" and case.kind in ("attribute", "table", "hostile"):
                    continue  # h5py cannot edit a file flagged open for write
                copy = folder / f"{name}-case{i}"
                shutil.copytree(base, copy)
                case.edit(copy)
                result, detail = outcome(copy, expected, args.timeout)
                table[(case.kind, "library", result)] += 1
                if result not in OK:
                    failures.append((name, case.kind, case.name, "library", result, detail))
                if args.cli_every and i % args.cli_every == 0:
                    for argv in commands:
                        result = cli_outcome(copy, argv, cli_expected[argv[0]], args.timeout)
                        table[(case.kind, argv[0], result)] += 1
                        if result not in OK:
                            failures.append((name, case.kind, case.name, argv[0], result, ""))
                shutil.rmtree(copy)
        if args.families != "none":
            _run_families(folder, table, failures, args.family)
    kinds = sorted({k for k, _, _ in table})
    print(f"{sum(table.values())} runs in {time.monotonic() - started:.0f} s")
    print("| case kind | runs | " + " | ".join(OUTCOMES) + " |")
    print("|---|---:|" + "---:|" * len(OUTCOMES))
    for kind in kinds:
        counts = [
            sum(v for (k, _, r), v in table.items() if k == kind and r == o) for o in OUTCOMES
        ]
        print(f"| {kind} | {sum(counts)} | " + " | ".join(map(str, counts)) + " |")
    totals = [sum(v for (_, _, r), v in table.items() if r == o) for o in OUTCOMES]
    print(f"| all | {sum(totals)} | " + " | ".join(map(str, totals)) + " |")
    for failure in failures:
        print("FAILED", *failure)
    sys.exit(1 if failures else 0)


def _run_families(folder: Path, table: Counter, failures: list, only: list | None) -> None:
    """Issue 40's families (tests/fuzz_scenarios.py), each scenario once (``only``:
    those families)."""
    for name, make in FAMILIES.items():
        if only and name not in only:
            continue
        place = folder / make.__name__
        place.mkdir()
        for family, label, scenario in make(place):
            result, detail = scenario()
            table[(family, "cli", result)] += 1
            print(f"{family:10s} {label:32s} {result:12s} {detail[:90]}", flush=True)
            if result not in OK:
                failures.append((family, label, "cli", result, detail))


if __name__ == "__main__":
    main()
