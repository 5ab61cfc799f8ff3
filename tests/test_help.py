"""What `--help` teaches: every command's help reads at 80 columns and says what the
code does (issue 39)."""

from __future__ import annotations

import re

import pytest

from gradstat.cli.main import COMMANDS
from tests.helpers import run_cli


@pytest.fixture(autouse=True)
def _eighty_columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")


@pytest.mark.parametrize("command", list(COMMANDS))
def test_help_names_types_as_people_do(capsys, command):
    """Regression: compare --help showed RUN <list[Path]>, merge DEST <path>."""
    result = run_cli(capsys, command, "--help")
    assert result.code == 0, result
    assert not re.search(r"<(list\[)?(path|Path|str|int|float|bool)\]?>", result.stdout)
    assert max(map(len, result.stdout.splitlines())) <= 80


def test_several_paths_read_path_dots(capsys):
    out = run_cli(capsys, "compare", "--help").stdout
    assert re.search(r"RUN\s+PATH\.\.\.", out), out


def test_merge_summary_says_it_joins_into_one(capsys):
    """Regression: 'Join a capture written by several nodes into separate folders' read
    as the opposite of what merge does."""
    out = run_cli(capsys, "--help").stdout
    assert "into one capture" in " ".join(out.split()), out
    assert "into separate folders" not in " ".join(out.split())


def test_recommend_help_lists_its_real_default_candidates(capsys):
    """Regression: 'every compressor but none', though redsync-sidco is left out too."""
    from gradstat.analysis.recommend import DEFAULT_CANDIDATES

    text = " ".join(run_cli(capsys, "recommend", "--help").stdout.replace("│", " ").split())
    default = text.split("--compressors")[1].split("[default:")[1].split("]")[0]
    assert re.findall(r"[a-z0-9-]+", default) == DEFAULT_CANDIDATES.split(",")
    assert "every built-in but none and redsync-sidco" in text
