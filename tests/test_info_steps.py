"""``gradstat info`` shows the steps missing between the first and the last recorded one
(a step dropped with a warning during capture), at the capture's stride."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gradstat.cli.info import missing_steps
from gradstat.store import layer_table, write_capture
from tests.helpers import run_cli


@pytest.mark.parametrize(
    ("steps", "every", "count", "first"),
    [
        ([0, 1, 2], 1, 0, []),
        ([0, 2], 1, 1, [1]),  # the case: 2 recorded, 0..2
        ([0, 10, 40], 10, 2, [20, 30]),
        ([5, 15, 35], 10, 1, [25]),  # labels that start anywhere
        ([0, 20, 40], 10, 2, [10, 30]),  # every says 10, the rows sit 20 apart
        ([0, 20, 40], None, 0, []),  # nothing says so without every
        ([0, 3, 4, 30], 1, 27, [1, 2, 5, 6, 7, 8, 9, 10, 11, 12]),
        ([7], 1, 0, []),
    ],
)
def test_missing_steps_against_a_listed_answer(steps, every, count, first):
    assert missing_steps(steps, every) == {"count": count, "first": first}


def test_info_names_the_missing_steps(tmp_path, capsys):
    layers = layer_table([("w", (4,))])
    grads = np.ones((2, 3, 4), dtype=np.float32)
    path = write_capture(tmp_path / "gap", grads, layers, steps=[0, 1, 3], meta={"every": 1})
    result = run_cli(capsys, "info", path)
    assert result.code == 0, result
    assert "3 recorded: 0..1, 3" in result.stdout
    summary = json.loads(run_cli(capsys, "info", path, "--json").stdout)
    assert summary["missing_steps"] == {"count": 1, "first": [2]}
