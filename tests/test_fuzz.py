"""Issue 30's fuzz run, small and seeded: no damaged capture reads as data, hangs or dies.

Every case (tests/fuzz_cases.py) edits a copy of a small capture and reads it through
the library in a forked child with a time limit: the outcome must be an error naming a
file of the capture, or exactly the undamaged answer. A few cases also run the command
line, which must exit 1 with one ``Error:`` line naming the file.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from gradstat.store import layer_table, write_capture
from gradstat.store.schema import rank_file_name
from tests.fuzz_cases import OK, digest, make_cases, outcome

NUMEL = 300_000  # two chunks per row


def _capture(path, seed):
    rng = np.random.default_rng(seed)
    grads = rng.normal(size=(2, 3, NUMEL)).astype(np.float32)
    layers = layer_table([("a.weight", (500, 400)), ("a.bias", (500,)), ("b.weight", (99_500,))])
    return write_capture(path, grads, layers, losses=rng.random((2, 3)))


def _killed(path):
    """A capture whose writers died: rank files flagged open for write (SWMR reads)."""
    from tests.test_cli_faults import _killed_capture

    return _killed_capture(path)


def _run_all(tmp_path, base, foreign, seed, n, timeout=60.0, kinds=None):
    expected = digest(base)
    results = []
    cases = make_cases(base, foreign, np.random.default_rng(seed), n)
    for i, case in enumerate(c for c in cases if kinds is None or c.kind in kinds):
        copy = tmp_path / f"case{i}"
        shutil.copytree(base, copy)
        case.edit(copy)
        result, detail = outcome(copy, expected, timeout)
        results.append((case, result, detail))
        shutil.rmtree(copy)
    return results


def _check(results):
    bad = [(c.kind, c.name, r, d) for c, r, d in results if r not in OK]
    assert not bad, "\n".join(map(str, bad))
    by_kind = Counter((c.kind, r) for c, r, _ in results)
    return by_kind


# slow: test_integrity.py's damaged rows and test_the_command_line_says_one_error_line's
# damaged files cover each kind of damage in make test; this one tries every copy
@pytest.mark.slow
def test_damaged_copies_are_errors_or_the_same_answer(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADSTAT_OPEN_TIMEOUT", "3")
    base = _capture(tmp_path / "base", 0)
    foreign = _capture(tmp_path / "foreign", 1)
    by_kind = _check(_run_all(tmp_path, base, foreign, seed=30, n=4))
    # the checks that must fire: every flipped row value, swap and foreign file
    assert by_kind[("grad flip", "same")] == 0 and by_kind[("grad flip", "error")] == 4
    for kind in ("swap", "foreign", "table"):
        assert by_kind[(kind, "error")] >= 1 and by_kind[(kind, "same")] == 0, by_kind
    assert by_kind[("truncation", "same")] == 0


def test_damaged_metadata_of_a_killed_capture(tmp_path, monkeypatch):
    """Rank files flagged "open for write" are read in SWMR mode, where HDF5 retries
    damaged metadata: each case still answers within the time limit."""
    monkeypatch.setenv("GRADSTAT_OPEN_TIMEOUT", "2")
    base = _killed(tmp_path / "killed")
    kinds = ("metadata flip", "truncation", "zeroed page")
    by_kind = _check(_run_all(tmp_path, base, None, seed=31, n=3, kinds=kinds))
    assert by_kind[("metadata flip", "error")] >= 1, by_kind


@pytest.mark.parametrize(
    "edit",
    [
        lambda p: os.truncate(p / rank_file_name(1), 1024),
        lambda p: _zero_page(p / "capture.h5", 4096),
    ],
    ids=["truncated", "root page zeroed"],
)
def test_the_command_line_says_one_error_line(tmp_path, edit):
    base = _capture(tmp_path / "base", 0)
    edit(base)
    env = {**os.environ, "GRADSTAT_OPEN_TIMEOUT": "5"}
    done = subprocess.run(
        [sys.executable, "-m", "gradstat", "similarity", str(base)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert done.returncode == 1, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), done.stderr
    assert str(base) in lines[0] and "Traceback" not in done.stderr


def _zero_page(file, at):
    with open(file, "r+b") as f:
        f.seek(at)
        f.write(bytes(4096))
