"""`gradstat info` says what a capture holds in words a new user reads right (issue 39)."""

from __future__ import annotations

import numpy as np
import pytest

from gradstat.store import layer_table, write_capture
from tests.helpers import run_cli


@pytest.mark.parametrize(
    "steps, shown",
    [
        ([0, 10, 20], "3 recorded: 0..20 every 10"),  # regression: "3 recorded: 0..20"
        ([0, 1, 2, 3], "4 recorded: 0..3"),
        ([0, 1, 2, 7, 9], "5 recorded: 0..2, 7, 9"),
        ([5], "1 recorded: 5"),
    ],
)
def test_steps_show_their_stride(capsys, tmp_path, steps, shown):
    grads = np.zeros((1, len(steps), 4), dtype=np.float32)
    path = write_capture(tmp_path / "run", grads, layer_table([("w", (4,))]), steps=steps)
    result = run_cli(capsys, "info", path)
    assert result.code == 0, result
    assert shown in result.stdout
    assert "1 learner " in result.stdout  # regression: "1 learners"


def test_verify_says_what_it_read(capsys, synthetic_capture):
    """Regression: info --verify printed exactly what info prints."""
    path, grads = synthetic_capture
    result = run_cli(capsys, "info", path, "--verify")
    assert result.code == 0, result
    rows = grads.shape[0] * grads.shape[1]
    assert f"--verify: read {rows} rows of 3 learners" in result.stdout
    assert "every row matches its CRC-32C" in result.stdout
