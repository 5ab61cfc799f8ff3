"""Text that came from a capture is shown, never obeyed (issue 40.5): control characters
in layer names and other capture strings reach the terminal escaped, and CSV cells that
a spreadsheet would run as formulas are written inert."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from gradstat.store import layer_table, write_capture
from gradstat.untrusted import printable, safe_cell
from tests.helpers import assert_clean_error, run_cli

NAMES = [
    "conv\x1b]0;owned\x07.weight",  # sets the terminal's title
    "fc\x1b[2J.weight",  # clears the screen
    '=HYPERLINK("http://example.invalid","x")',
    "+1+cmd",
    "-2",
    "@SUM(A1)",
    "\ttab",
    "\rreturn",
    "bidi\u202eevil",
    "plain.bias",
]


def test_printable_and_safe_cell_against_their_definitions():
    assert printable("a\x1b[2Jb\x07\n\t\x7f\x85\u202e") == "a\\x1b[2Jb\\x07\\n\\t\\x7f\\x85\\u202e"
    assert printable("layers.0.weight é 中") == "layers.0.weight é 中"
    for start in ("=", "+", "-", "@", "\t"):
        assert safe_cell(start + "x") == "'" + start + "x"
    # a carriage return would split the CSV row: escaped, it starts no formula either
    assert safe_cell("\rx") == "\\rx" and safe_cell("a\x1b[2Jb\nc\td") == "a\\x1b[2Jb\nc\td"
    assert safe_cell("x=1") == "x=1" and safe_cell(-1.5) == -1.5 and safe_cell(None) is None


@pytest.fixture
def hostile(tmp_path):
    layers = layer_table([(name, (4,)) for name in NAMES])
    grads = np.random.default_rng(0).normal(size=(2, 2, 4 * len(NAMES))).astype(np.float32)
    meta = {"workload": "x\x1b[31mred", "command": "\x1b]8;;http://x\x07link"}
    return write_capture(tmp_path / "cap", grads, layers, meta=meta)


def test_info_shows_control_characters_escaped(hostile, capsys, monkeypatch):
    """Regression: ``info`` printed ESC]0;... and ESC[2J of layer names raw."""
    monkeypatch.setenv("COLUMNS", "200")
    result = run_cli(capsys, "info", hostile)
    assert result.code == 0, result.stderr
    assert "\x1b" not in result.stdout and "\x07" not in result.stdout
    assert "\u202e" not in result.stdout and "\r" not in result.stdout
    assert "conv\\x1b]0;owned\\x07.weight" in result.stdout and "x\\x1b[31mred" in result.stdout


def test_csv_cells_that_start_a_formula_are_inert(hostile, capsys, tmp_path):
    """Regression: ``--csv`` wrote a cell starting ``=HYPERLINK(``."""
    out = tmp_path / "layers.csv"
    assert run_cli(capsys, "info", hostile, "--csv", out).code == 0
    with open(out, newline="") as f:
        names = [row["name"] for row in csv.DictReader(f)]
    assert names == [safe_cell(name) for name in NAMES]  # one row each, read back whole
    assert names[2] == "'" + NAMES[2] and names[-1] == "plain.bias"
    assert not [n for n in names if n[:1] in ("=", "+", "-", "@", "\t", "\r")]
    assert names[0] == "conv\\x1b]0;owned\\x07.weight" and names[7] == "\\rreturn"


def test_an_error_line_shows_capture_text_escaped(hostile, tmp_path, capsys):
    """A capture's own text in an ``Error:`` line (here the compressor it names) is
    escaped too: the line stays one line and moves no cursor."""
    from gradstat.store.writer import finalize_root

    other = tmp_path / "other"
    write_capture(other, np.zeros((2, 2, 40), np.float32), layer_table([("w", (40,))]))
    import h5py

    with h5py.File(other / "capture.h5", "r+") as f:
        f.attrs["compressor"] = "evil\x1b[2J\n.py:X"
    finalize_root(other)
    result = run_cli(capsys, "compare", hostile, other)
    assert_clean_error(result, 2)
    assert len(result.stderr.strip().splitlines()) == 1
    assert "\x1b" not in result.stderr and "evil\\x1b[2J\\n.py:X" in result.stderr
