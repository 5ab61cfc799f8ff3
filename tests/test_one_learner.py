"""A capture of one learner: nothing is communicated, and the words say so (issue 39)."""

from __future__ import annotations

import numpy as np
import pytest

from gradstat.store import layer_table, write_capture
from tests.helpers import assert_clean_error, run_cli


@pytest.fixture
def alone(tmp_path):
    grads = np.random.default_rng(0).laplace(size=(1, 4, 2000)).astype(np.float32)
    return write_capture(tmp_path / "alone", grads, layer_table([("w", (40, 50))]))


def test_recommend_asks_for_a_cluster_size(capsys, alone):
    """Regression: 'for 1 learners, against 0 ms for the dense fp32 all-reduce (0x)'."""
    result = run_cli(capsys, "recommend", alone, "--error-budget", "0.5")
    assert_clean_error(result, code=2)
    assert "one learner, which communicates nothing" in result.stderr
    assert "--cluster-size N" in result.stderr


def test_replay_and_report_say_one_learner(capsys, alone, tmp_path):
    result = run_cli(capsys, "replay", alone, "--compressors", "topk", "--ratios", "0.01")
    assert result.code == 0, result
    text = " ".join(result.stdout.split())
    assert "replay of 1 learner over" in text and "1 learners" not in text
    assert "One learner communicates nothing" in text
    out = tmp_path / "r.html"
    args = ["--compressors", "topk", "--ratios", "0.01"]
    result = run_cli(capsys, "report", alone, "-o", out, *args)
    assert result.code == 0, result
    page = out.read_text()
    assert "1 learners" not in page and "(0x)" not in page
    assert "One learner communicates nothing" in page
