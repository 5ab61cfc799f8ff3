"""A capture is data, never code (issue 40.1): no command imports or runs anything a
capture names. A capture's ``compressor`` attribute may name a file shipped inside it
(``CAP/evil.py:Evil``) or any importable module (``this:Zen`` prints the Zen of
Python); ``compare`` and ``report`` ask the user to name such a compressor instead, and
``report`` reads no capture it was not given."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import fuzz_scenarios as scenarios
from tests.fuzz_scenarios import ZEN, compressed, small
from tests.helpers import assert_clean_error, run_cli


@pytest.fixture
def planted(tmp_path):
    """``runs/mine`` (dense), ``runs/evil`` naming its own ``evil.py`` (which writes
    ``MARKER`` when imported), ``runs/zen`` naming ``this:Zen``."""
    runs = tmp_path / "runs"
    mine = small(runs / "mine")
    marker = tmp_path / "MARKER"
    evil = scenarios.planted(runs / "evil", marker)
    return mine, evil, compressed(runs / "zen", "this:Zen"), marker


def test_compare_never_imports_the_compressor_a_capture_names(planted, capsys):
    mine, evil, zen, marker = planted
    for run in (evil, zen):
        result = run_cli(capsys, "compare", mine, run)
        assert_clean_error(result, 2)
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert f"--trained-with {run}=SPEC" in result.stderr
        assert "does not import code that a capture names" in result.stderr
        assert ZEN not in result.stdout + result.stderr
    assert not marker.exists()


def test_a_compressor_the_user_names_replays_the_run(planted, capsys, tmp_path):
    """The user's own spec replays a run that recorded another (here the registry's
    top-k for the file the capture names): the run is compared, nothing it names ran."""
    mine, evil, _, marker = planted
    result = run_cli(capsys, "compare", mine, evil, "--trained-with", f"{evil}=topk", "--json")
    assert result.code == 0, result.stderr
    summary = json.loads(result.stdout)["summary"]
    assert [row["run"] for row in summary] == ["mine", "evil"]
    assert summary[1]["replayed_bytes"] > 0
    assert not marker.exists()
    wrong = run_cli(capsys, "compare", mine, evil, "--trained-with", f"{mine}=topk")
    assert_clean_error(wrong, 2)
    assert "trained without a compressor" in wrong.stderr
    other = run_cli(capsys, "compare", mine, evil, "--trained-with", f"{tmp_path}=topk")
    assert_clean_error(other, 2)
    assert "not one of the runs compared" in other.stderr
    bad = run_cli(capsys, "compare", mine, evil, "--trained-with", "topk")
    assert_clean_error(bad, 2)
    assert "expected RUN=SPEC" in bad.stderr


def test_a_builtin_recorded_in_the_capture_needs_no_option(tmp_path, capsys):
    mine = small(tmp_path / "mine")
    topk = compressed(tmp_path / "topk", "topk")
    result = run_cli(capsys, "compare", mine, topk, "--json")
    assert result.code == 0, result.stderr
    # a registry name with text that is no parameter of it: an error, never an import
    zen = compressed(tmp_path / "zen", "topk:Zen")
    assert_clean_error(run_cli(capsys, "compare", mine, zen), 2)


def test_report_with_a_run_naming_code_stops_before_any_work(planted, capsys, tmp_path):
    mine, evil, zen, marker = planted
    out = tmp_path / "report.html"
    for run in (evil, zen):
        result = run_cli(capsys, "report", mine, "-o", out, "--with", run)
        assert_clean_error(result, 2)
        assert f"--trained-with {run}=SPEC" in result.stderr
        assert ZEN not in result.stdout + result.stderr
    assert not marker.exists() and not out.exists()


@pytest.mark.slow  # a whole report (the test above covers --with before any work)
def test_report_reads_no_capture_beside_its_own(planted, tmp_path):
    """Regression: ``report mine`` listed mine's folder, opened every capture there and
    imported the compressor one of them named. The neighbours here name code; in a
    subprocess whose audit hook records every folder listed and module imported, the
    folder is never listed and nothing they name is imported."""
    mine, evil, zen, marker = planted
    out = tmp_path / "report.html"
    script = (
        "import sys\n"
        "seen = []\n"
        "events = ('os.listdir', 'os.scandir', 'import')\n"
        "sys.addaudithook(lambda e, a: seen.append(f'{e} {a[0]}') if e in events else None)\n"
        "from gradstat.cli.main import main\n"
        "try:\n"
        f"    main(['report', {str(mine)!r}, '-o', {str(out)!r}, '--compressors', 'fp16'])\n"
        "finally:\n"
        "    print('\\n'.join(seen), file=open(sys.argv[1], 'w'))\n"
    )
    log = tmp_path / "events.txt"
    done = subprocess.run(
        [sys.executable, "-c", script, str(log)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)},
    )
    assert done.returncode == 0, done.stderr
    assert out.exists() and not marker.exists() and ZEN not in done.stdout
    events = log.read_text().splitlines()
    assert any(e.startswith("import gradstat.report") for e in events)  # the hook worked
    assert "import this" not in events and not [e for e in events if "evil" in e]
    assert not [e for e in events if e.split(" ", 1)[1] in (str(mine.parent), str(evil), str(zen))]
