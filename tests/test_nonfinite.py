"""NaN/Inf gradients and all-zero layers: clear errors, never hangs or silent nonsense."""

from __future__ import annotations

import signal

import numpy as np
import pytest
import torch

from gradstat.errors import DataError
from gradstat.stats.thresholds import estimate_threshold
from gradstat.store import layer_table, write_capture
from tests.helpers import assert_clean_error, run_cli


@pytest.fixture
def nonfinite_capture(tmp_path):
    layers = layer_table([("a.weight", (40, 50)), ("zero.bias", (10,))])
    grads = np.random.default_rng(0).laplace(size=(2, 4, 2010)).astype(np.float32)
    grads[:, :, 2000:] = 0.0  # an all-zero layer
    grads[1, 2, 5] = np.nan
    grads[0, 3, 7] = np.inf
    return write_capture(tmp_path / "nonfinite", grads, layers)


@pytest.mark.parametrize(
    "args",
    [
        ["similarity", "--ratio", "0.01"],
        ["buildup", "--ratios", "0.01", "--on", "ef"],
        ["overlap", "--ratio", "0.01"],
        ["replay", "--compressors", "topk,dgc", "--ratios", "0.01"],
        ["recommend", "--error-budget", "0.5"],
    ],
)
def test_set_analyses_and_replay_name_the_step_and_learner(nonfinite_capture, capsys, args):
    result = run_cli(capsys, args[0], nonfinite_capture, *args[1:])
    assert_clean_error(result, code=1)
    assert "step 2, learner 1: 1 NaN/Inf gradient values" in result.stderr


def test_leaving_the_bad_steps_out_works(nonfinite_capture, capsys):
    result = run_cli(capsys, "similarity", nonfinite_capture, "--ratio", "0.01", "--steps", "0,1")
    assert result.code == 0, result


def test_fit_excludes_counts_and_warns(nonfinite_capture, capsys):
    result = run_cli(capsys, "fit", nonfinite_capture, "--ratios", "0.01", "--steps", "2")
    assert result.code == 0, result
    assert "1 NaN/Inf values excluded" in result.stderr


def test_all_zero_layer_is_refused_clearly(nonfinite_capture, capsys):
    result = run_cli(capsys, "fit", nonfinite_capture, "--scope", "zero", "--ratios", "0.1")
    assert result.code != 0 and "Traceback" not in result.stderr
    assert "zero" in result.stderr


@pytest.mark.parametrize("estimator", ["topk", "dgc", "gaussiank", "redsync", "sidco-gpd"])
def test_estimators_refuse_nonfinite_values_instead_of_looping(estimator):
    """Regression: DGC's x0.8 retry loop never ended on an Inf threshold."""
    values = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    values[::50] = float("inf")
    values[1] = float("nan")
    signal.alarm(20)  # a hang fails the test instead of the suite
    try:
        with pytest.raises(DataError, match="NaN"):
            estimate_threshold(values, 0.001, estimator)
    finally:
        signal.alarm(0)
