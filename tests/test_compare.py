"""``gradstat compare`` on captures with known contents: a dense run and a compressed
run whose ``sent`` rows were made by the replay's top-k with error feedback."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from gradstat.analysis.compare import compare
from gradstat.store import layer_table, write_capture
from gradstat.store.schema import rank_file_name
from gradstat.store.writer import RankFileWriter, finalize_root, write_root
from tests.helpers import assert_clean_error, run_cli
from tests.reference_compressors import Reference

LAYERS = layer_table([("fc.weight", (20, 30)), ("fc.bias", (20,))])
D = LAYERS[-1].stop
RATIO = 0.1
K = round(RATIO * D)


def grads(seed: int, steps: int = 6) -> np.ndarray:
    rng = np.random.default_rng(seed)
    shared = rng.laplace(size=(1, steps, D))
    return (shared + 0.5 * rng.laplace(size=(2, steps, D))).astype(np.float32)


def write_compressed(path, g: np.ndarray, losses: np.ndarray) -> list[float]:
    """A capture as ``capture --compressor topk --ratio 0.1`` writes it; returns the
    relative error of the update applied at each step (by brute force). The ``sent``
    rows are the whole-step reference's top-k with error feedback."""
    path.mkdir()
    scheme = Reference("topk", {}, RATIO, K, D, [], 0, 2)
    meta = {
        "workload": "arrays",
        "seed": 0,
        "compressor": "topk",
        "compressor_ratio": RATIO,
        "compressor_settings": json.dumps({"k": K, "ratio": RATIO}),
    }
    write_root(path, LAYERS, 2, "float32", meta)
    writers = [RankFileWriter(path / rank_file_name(r), r, D, sent=True) for r in (0, 1)]
    errors = []
    for step in range(g.shape[1]):
        exchange = scheme.step(torch.from_numpy(g[:, step]))
        mean = g[:, step].astype(np.float64).mean(0)
        applied = exchange.sent.double().numpy().mean(0)
        errors.append(float(((applied - mean) ** 2).sum() / (mean**2).sum()))
        for r, writer in enumerate(writers):
            writer.append(step, losses[r, step], g[r, step], exchange.sent[r].numpy(), 8.0 * K)
    for writer in writers:
        writer.close()
    finalize_root(path)
    return errors


@pytest.fixture
def runs(tmp_path):
    dense = grads(0)
    losses = np.linspace(3, 1, 12).reshape(2, 6)
    write_capture(tmp_path / "dense", dense, LAYERS, losses=losses, meta={"seed": 0})
    same = write_compressed(tmp_path / "same", dense, losses + 0.1)
    drifted = dense.copy()
    # the compressed run leaves the dense trajectory: the learners stop agreeing
    drifted[:, 3:] = np.random.default_rng(7).standard_normal((2, 3, D))
    write_compressed(tmp_path / "drift", drifted, losses + 0.2)
    return tmp_path, same


def test_measured_replayed_and_predicted_agree_on_the_dense_trajectory(runs):
    path, errors = runs
    result = compare([path / "dense", path / "same", path / "drift"])
    same = result.errors[result.errors["run"] == "same"]
    np.testing.assert_allclose(same["measured_rel_error"], errors, rtol=1e-6)
    np.testing.assert_allclose(same["replayed_rel_error"], errors, rtol=1e-6)
    np.testing.assert_allclose(same["predicted_rel_error"], errors, rtol=1e-6)
    assert (same["measured_bytes"] == 8 * K).all() and (same["predicted_bytes"] == 8 * K).all()
    summary = result.summary.set_index("run")
    assert math.isnan(summary.loc["same", "divergence_step"])
    # the drifted run: identical for 3 steps, then the open-loop replay is off
    drift = result.errors[result.errors["run"] == "drift"].set_index("step")
    for step in range(3):
        assert drift.loc[step, "predicted_rel_error"] == pytest.approx(
            drift.loc[step, "measured_rel_error"]
        )
    gap = (drift["predicted_rel_error"] - drift["measured_rel_error"]).abs()
    first = next(s for s in range(6) if gap[s] > 0.25 * drift.loc[s, "measured_rel_error"])
    assert summary.loc["drift", "divergence_step"] == first >= 3
    assert summary.loc["dense", "loss_first"] == pytest.approx((3 + 1 + 10 / 11) / 2)


def test_compare_cli_tables_json_and_plot(runs, capsys, tmp_path):
    path, _ = runs
    result = run_cli(capsys, "compare", path / "dense", path / "same", "--json")
    assert result.code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["dense_run"] == "dense"
    assert [r["label"] for r in doc["runs"]] == ["dense", "topk at 0.1"]
    assert len(doc["runs"][0]["loss_per_learner"]) == 2
    shown = run_cli(capsys, "compare", path / "dense", path / "drift", "--plot", tmp_path / "c.png")
    assert shown.code == 0, shown.stderr
    assert (
        "online" in shown.stdout
        and "diverges" in shown.stdout
        and (tmp_path / "c.png").stat().st_size > 0
    )
    assert_clean_error(run_cli(capsys, "compare", path / "dense"), 2)


def test_report_section_only_with_the_runs_named(runs):
    from gradstat.report.training import training_section
    from gradstat.store import open_capture

    path, _ = runs
    with open_capture(path / "dense") as cap:
        section = training_section(cap, [path / "drift", path / "same"])
        assert training_section(cap, []) is None  # never the runs beside it
    assert section is not None and section.key == "training" and len(section.figures) == 1
    assert list(section.tables[0][1]["run"]) == ["dense", "drift", "same"]
    assert "open-loop" in section.reading


def test_unlike_runs_are_warned_and_no_dense_run_is_said(runs, capsys, tmp_path):
    """Regression: captures of 4 and 2 learners, or of different steps, compared without
    a word; without a dense run the note read 'over the dense run's, none (open-loop)'."""
    path, _ = runs
    four = np.concatenate([grads(0, steps=4)] * 2)  # 4 learners, steps 0..3
    write_capture(tmp_path / "four", four, LAYERS, meta={"seed": 0})
    result = run_cli(capsys, "compare", tmp_path / "four", path / "same")
    assert result.code == 0, result.stderr
    err = " ".join(result.stderr.split())
    assert "same trained with 2 learners and four with 4" in err
    assert "same recorded 6 steps (0..5) and four 4 (0..3)" in err
    result = run_cli(capsys, "compare", path / "same", path / "drift")
    assert result.code == 0, result.stderr
    out = " ".join(result.stdout.split())
    assert "none (open-loop)" not in out and "No dense run among the runs" in out
