"""Commands that compute nothing start without torch, numba, scipy or pandas (issue 28).

Each command runs in a fresh interpreter, which then reports the heavy libraries it
loaded (``sys.modules``); ``benchmarks/startup.py`` measures the time this saves.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from gradstat.store import layer_table, write_capture

HEAVY = ("torch", "numba", "scipy", "pandas", "matplotlib")

PROBE = """
import json, sys
argv = json.loads(sys.argv[1])
from gradstat.cli.main import main
code = 0
try:
    main(argv)
except SystemExit as exc:
    code = exc.code
heavy = sorted(m for m in {HEAVY!r} if m in sys.modules)
print("PROBE", json.dumps({{"code": code, "heavy": heavy}}))
"""


def _probe(argv: list[str]) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(HEAVY=HEAVY), json.dumps(argv)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    line = next(line for line in out.splitlines() if line.startswith("PROBE "))
    return json.loads(line[len("PROBE ") :])


@pytest.fixture(scope="module")
def small_capture(tmp_path_factory):
    path = tmp_path_factory.mktemp("startup") / "cap"
    grads = np.random.default_rng(0).standard_normal((2, 2, 64)).astype(np.float32)
    return write_capture(path, grads, layer_table([("w", (64,))]))


@pytest.mark.parametrize(
    "argv", [["--version"], ["--help"], ["merge", "--help"], ["info", "--help"], []]
)
def test_commands_that_compute_nothing_load_no_heavy_library(argv):
    result = _probe(argv)
    assert result["code"] in (0, 2)  # no arguments: the help, with exit code 2
    assert result["heavy"] == []


def test_info_reads_a_capture_without_torch(small_capture):
    result = _probe(["info", str(small_capture), "--json"])
    assert result == {"code": 0, "heavy": []}


def test_an_analysis_loads_torch_when_it_runs(tmp_path):
    # the probe must be able to fail: a command that computes loads torch as it starts
    result = _probe(["fit", str(tmp_path / "missing")])
    assert result["code"] != 0  # the missing capture, reported after the imports
    assert "torch" in result["heavy"]


def test_import_gradstat_is_light_and_the_capture_api_loads_on_use():
    code = (
        "import sys, gradstat\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
        "print(gradstat.GradientCapture.__name__, gradstat.open_capture.__name__)\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split("\n")
    assert out[:3] == ["[]", "GradientCapture open_capture", "True"]


def test_the_help_lists_the_registrys_compressors():
    from gradstat.compressors.names import BUILTIN
    from gradstat.compressors.registry import REGISTRY

    assert tuple(REGISTRY) == BUILTIN


def test_the_listed_help_is_the_docstring_each_command_runs_with():
    from gradstat.cli.main import COMMANDS, command_docstring, load_command

    for name, target in COMMANDS.items():
        command = load_command(name)
        assert command.name == name
        assert command.help == command_docstring(target) != ""
