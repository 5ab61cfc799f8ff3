"""``gradstat consistency``: cosines, dispersions and diversity against plain numpy."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy import stats

from gradstat.analysis.consistency import (
    MEASURES,
    ConsistencyParams,
    consistency,
    cosine_matrix,
)
from gradstat.store import layer_table, open_capture, write_capture
from tests.helpers import run_cli


def _plain(rows: np.ndarray, losses: np.ndarray) -> dict:
    """The measures of one step from the learners' rows (float64) and losses."""
    norms = np.sqrt((rows**2).sum(axis=1))
    n = len(rows)
    cosines = [rows[a] @ rows[b] / (norms[a] * norms[b]) for a in range(n) for b in range(a + 1, n)]
    return {
        "cosine_mean": np.mean(cosines),
        "cosine_min": np.min(cosines),
        "norm_mean": norms.mean(),
        "norm_cv": norms.std() / norms.mean(),
        "loss_mean": losses.mean(),
        "loss_cv": losses.std() / abs(losses.mean()),
        "diversity": (norms**2).sum() / (rows.sum(axis=0) ** 2).sum(),
        "cosines": cosines,
    }


def test_every_field_equals_plain_numpy_on_a_real_capture(real_capture):
    with open_capture(real_capture) as cap:
        result = consistency(cap)
        expected = [
            _plain(cap.read_step(s).double().numpy(), cap.losses[:, i])
            for i, s in enumerate(cap.steps)
        ]
    steps = result.steps
    for column in ("norm_mean", "norm_cv", "loss_mean", "loss_cv", "diversity"):
        np.testing.assert_allclose(steps[column], [e[column] for e in expected], rtol=1e-6)
    # cosines of float32 rows: 1e-6 of their size, or float32's own rounding near 0
    for column in ("cosine_mean", "cosine_min"):
        np.testing.assert_allclose(
            steps[column], [e[column] for e in expected], rtol=1e-6, atol=1e-8
        )
    cosines = [c for e in expected for c in e["cosines"]]
    np.testing.assert_allclose(result.pairs["cosine"], cosines, rtol=1e-6, atol=1e-8)
    assert list(result.pairs[["learner_a", "learner_b"]].iloc[:3].itertuples(index=False)) == [
        (0, 1),
        (0, 2),
        (1, 2),
    ]


def test_identical_learners_have_cosine_1_and_no_dispersion(tmp_path):
    rng = np.random.default_rng(1)
    grads = np.repeat(rng.standard_normal((1, 3, 400)), 4, axis=0).astype(np.float32)
    losses = np.full((4, 3), 2.5)
    path = write_capture(tmp_path / "same", grads, layer_table([("w", (400,))]), losses=losses)
    with open_capture(path) as cap:
        result = consistency(cap)
    steps = result.steps
    np.testing.assert_allclose(steps[["cosine_mean", "cosine_min"]], 1.0, rtol=1e-6)
    np.testing.assert_allclose(steps[["norm_cv", "loss_cv"]], 0.0, atol=1e-7)
    np.testing.assert_allclose(steps["diversity"], 0.25, rtol=1e-6)  # 1/n
    np.testing.assert_allclose(cosine_matrix(result.pairs).to_numpy(), 1.0, rtol=1e-6)


def test_learners_with_unrelated_data_have_cosines_near_0(tmp_path):
    d = 200_000
    grads = np.random.default_rng(2).standard_normal((4, 2, d)).astype(np.float32)
    path = write_capture(tmp_path / "unrelated", grads, layer_table([("w", (d,))]))
    with open_capture(path) as cap:
        result = consistency(cap)
    assert result.pairs["cosine"].abs().max() < 5 / np.sqrt(d)  # 5 sd of a random cosine
    np.testing.assert_allclose(result.steps["diversity"], 1.0, atol=0.02)


def _ranked(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rho as Pearson's correlation of the ranks (ties averaged)."""
    return float(np.corrcoef(stats.rankdata(x), stats.rankdata(y))[0, 1])


def test_rank_correlation_with_a_compressors_error(tmp_path, capsys):
    """Learners that agree more at some steps: top-k's error on each learner against
    each measure, equal to a plain rank correlation of the plain values."""
    rng = np.random.default_rng(3)
    d, n, steps = 2000, 4, 6
    shared = rng.laplace(size=(1, steps, d))
    weight = np.linspace(0.2, 3.0, steps)[None, :, None]
    grads = (weight * shared + rng.standard_normal((n, steps, d))).astype(np.float32)
    losses = 1 + rng.random((n, steps))
    path = write_capture(tmp_path / "agree", grads, layer_table([("w", (d,))]), losses=losses)
    result = run_cli(
        capsys, "consistency", path, "--compressors", "topk,fp16", "--ratios", "0.01", "--json"
    )
    assert result.code == 0, result.stderr
    document = json.loads(result.stdout)
    records = {r["step"]: r for r in document["records"]}
    errors = []
    for s in range(steps):
        rows = grads[:, s].astype(np.float64)
        kept = np.sort(rows**2, axis=1)[:, -20:].sum(axis=1)  # k = 20
        errors.append(np.mean(1 - kept / (rows**2).sum(axis=1)))
    top = [r for r in document["compressors"] if r["compressor"] == "topk"]
    np.testing.assert_allclose([r["rel_error"] for r in top], errors, rtol=1e-6)
    found = {r["measure"]: r for r in document["correlations"] if r["compressor"] == "topk"}
    assert set(found) == set(MEASURES)
    for measure in MEASURES:
        values = np.array([records[s][measure] for s in range(steps)])
        assert found[measure]["rho"] == pytest.approx(_ranked(values, np.array(errors)))
        assert found[measure]["steps"] == steps
    assert found["cosine_mean"]["rho"] < -0.5  # more agreement, a smaller top-k error


def test_the_tables_at_80_columns(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    grads = np.random.default_rng(4).standard_normal((3, 4, 300)).astype(np.float32)
    path = write_capture(tmp_path / "three", grads, layer_table([("w", (300,))]))
    result = run_cli(capsys, "consistency", path, "--compressors", "topk", "--ratios", "0.1")
    assert result.code == 0, result.stderr
    assert "mean cosine of the learners' gradients over 4 steps" in result.stdout
    assert "…" not in result.stdout  # no number cut
    assert max(len(line) for line in result.stdout.splitlines()) <= 80
    with open_capture(path) as cap:
        params = ConsistencyParams(compressors="topk", ratios=0.1)
        assert len(consistency(cap, params=params).correlations) == len(MEASURES)
