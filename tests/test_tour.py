"""The README's 30-second tour, run as a user would at 80 columns: every line fits and
no number is cut; plus the help texts and the options every analysis shares."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from gradstat.cli.main import COMMANDS, command_docstring, load_command
from tests.helpers import run_cli

ROOT = Path(__file__).parent.parent
ANALYSES = (
    "fit",
    "similarity",
    "buildup",
    "overlap",
    "noise",
    "consistency",
    "replay",
    "recommend",
    "report",
)


def tour_commands() -> list[list[str]]:
    """The tour's commands after ``gradstat``, in order."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## A 30-second tour", 1)[1].split("```", 2)[1]
    return [shlex.split(line)[1:] for line in block.strip().splitlines()]


def gradstat(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``gradstat ARGS`` in a subprocess at 80 columns with stdout and stderr piped."""
    env = {**os.environ, "COLUMNS": "80", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "gradstat", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def assert_fits_80_columns(text: str, what: str) -> None:
    for line in text.splitlines():
        assert len(line) <= 80, f"{what}: {len(line)} columns: {line!r}"
    assert "…" not in text, f"{what}: a cell was cut: {text}"
    assert not re.search(r"\d\.\s*$", text, flags=re.M), f"{what}: a number broken: {text}"


@pytest.mark.slow
def test_readme_tour_fits_80_columns(real_capture, tmp_path):
    commands = tour_commands()
    assert [c[0] for c in commands] == ["capture", "info", *ANALYSES]
    for args in commands[1:]:  # the capture is the session's real one
        args = [str(real_capture) if a == "captures/lm" else a for a in args]
        result = gradstat(*args, cwd=tmp_path)
        assert result.returncode == 0, (args, result.stderr)
        assert "Traceback" not in result.stderr
        assert_fits_80_columns(result.stdout, " ".join(args[:1]))
        if args[0] in ANALYSES[:-1]:
            assert "answer" in result.stdout, args  # the answer comes with the summary
    assert (tmp_path / "report.html").exists() and (tmp_path / "fit.png").exists()


def test_tour_names_only_real_options():
    """Every option the tour uses exists in its command (checked without running it)."""
    for args in tour_commands():
        params = load_command(args[0]).params
        names = {opt for param in params for opt in param.opts}
        for arg in args:
            if arg.startswith("-"):
                assert arg.split("=")[0] in names, (args[0], arg)


@pytest.mark.parametrize("command", ANALYSES)
def test_help_reads_cleanly_at_80_columns(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    result = run_cli(capsys, command, "--help")
    assert result.code == 0
    assert "--ratios" in result.stdout  # one option name per idea, in every analysis
    assert f"gradstat {command} [OPTIONS] CAPTURE" in result.stdout
    assert "{capture}" not in result.stdout and "<bool>" not in result.stdout
    assert "…" not in result.stdout  # no default cut off
    assert all(len(line) <= 80 for line in result.stdout.splitlines())


def test_top_level_help_lists_each_command_in_one_sentence(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    result = run_cli(capsys, "--help")
    assert result.code == 0
    for name, target in COMMANDS.items():
        first = command_docstring(target).split("\n\n")[0].split()
        assert first[0] in result.stdout, name
    assert "<bool>" not in result.stdout


def test_ratio_is_a_hidden_alias_of_ratios(synthetic_capture, capsys):
    path, _ = synthetic_capture
    for spelling in (["--ratio", "0.05"], ["--ratio=0.05"], ["--ratios", "0.05"]):
        result = run_cli(capsys, "overlap", path, *spelling, "--json")
        assert result.code == 0, result
        assert '"ratio": 0.05' in result.stdout
    assert "--ratio " not in run_cli(capsys, "overlap", "--help").stdout


def test_similarity_takes_several_ratios(synthetic_capture, capsys):
    path, _ = synthetic_capture
    result = run_cli(capsys, "similarity", path, "--ratios", "0.1,0.05")
    assert result.code == 0, result
    assert "At ratio 0.1," in result.stdout and "At ratio 0.05," in result.stdout
