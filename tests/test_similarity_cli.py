"""similarity / buildup / overlap: analyses against brute force, the CLI, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import reduce

import numpy as np
import pandas as pd
import pytest

from gradstat.analysis.buildup import BuildupParams, buildup
from gradstat.analysis.ef_vectors import ef_vectors
from gradstat.analysis.overlap import OverlapParams, overlap
from gradstat.analysis.selection import Selection, k_for
from gradstat.analysis.similarity import SimilarityParams, overlap_matrix, similarity
from gradstat.store import layer_table, open_capture, write_capture
from tests.helpers import Result, assert_clean_error, run_cli

LAYERS = layer_table([("a.weight", (20, 10)), ("a.bias", (4,)), ("b.weight", (300,))])
D = LAYERS[-1].stop


def run(capsys, *args: str) -> tuple[int, str, str]:
    """``gradstat ARGS`` in this process: (exit code, stdout, stderr)."""
    result = run_cli(capsys, *args)
    return result.code, result.stdout, result.stderr


def assert_error(result: tuple[int, str, str], *fragments: str) -> None:
    assert_clean_error(Result(*result))
    for fragment in fragments:
        assert fragment in result[2]


def _topk(x: np.ndarray, k: int) -> np.ndarray:
    return np.argsort(-np.abs(x), kind="stable")[:k]


def _capture(tmp_path, grads: np.ndarray, steps=None, name="cap"):
    return write_capture(tmp_path / name, grads.astype(np.float32), LAYERS, steps=steps)


def test_similarity_matches_numpy_sets(synthetic_capture):
    path, grads = synthetic_capture
    ratio = 0.05
    with open_capture(path) as cap:
        result = similarity(
            cap, Selection.of(cap, steps=[1, 4], learners=[0, 2]), SimilarityParams(ratio)
        )
    k = k_for(ratio, grads.shape[2])
    for step in (1, 4):
        g = grads[[0, 2], step]
        mean = g.mean(axis=0)
        sets = {0: _topk(g[0], k), 2: _topk(g[1], k), "mean": _topk(mean, k)}
        rows = result.pairs[result.pairs["step"] == step]
        for row in rows.itertuples():
            a, b = sets[row.learner_a], sets[row.learner_b]
            inter = np.intersect1d(a, b).size
            assert row.overlap == pytest.approx(inter / k)
            assert row.jaccard == pytest.approx(inter / np.union1d(a, b).size)
            assert row.hamming == np.setxor1d(a, b).size
            if row.learner_b == "mean":
                assert row.energy == pytest.approx(np.sum(mean[a] ** 2) / np.sum(mean**2), 1e-5)
        assert len(rows) == 1 + 2  # one learner pair, two learners vs the mean
        summary = result.steps[result.steps["step"] == step].iloc[0]
        union = np.union1d(sets[0], sets[2]).size
        assert summary["union"] == union
        assert summary["buildup"] == pytest.approx(union / k)
        assert summary["full_intersection"] == pytest.approx(
            np.intersect1d(sets[0], sets[2]).size / k
        )
        assert summary["random_overlap"] == pytest.approx(k / grads.shape[2])
        assert summary["leader"] == [0, 2][step % 2]
    matrix = overlap_matrix(result.pairs)
    assert list(matrix.index) == [0, 2, "mean"]
    assert (
        matrix.loc[0, 2]
        == matrix.loc[2, 0]
        == pytest.approx(result.pairs.query("learner_b == 2")["overlap"].mean())
    )
    # as docs/api.md lists it: of the result itself (regression: AttributeError, issue 39)
    assert overlap_matrix(result).equals(matrix)


def test_buildup_identical_disjoint_and_brute_force(tmp_path):
    rng = np.random.default_rng(0)
    same = np.repeat(rng.laplace(size=(1, 3, D)), 3, axis=0)
    disjoint = np.zeros((3, 3, D))
    for i in range(3):  # learner i lives on its own third of b.weight
        disjoint[i, :, 204 + i * 100 : 204 + (i + 1) * 100] = rng.normal(5.0, 1.0, (3, 100))
    with open_capture(_capture(tmp_path, same, name="same")) as cap:
        df = buildup(cap, Selection.of(cap), BuildupParams([0.02, 0.1]))
    assert np.allclose(df["buildup"], 1.0)
    with open_capture(_capture(tmp_path, disjoint, name="disjoint")) as cap:
        df = buildup(cap, Selection.of(cap, scope="b.weight"), BuildupParams([0.02]))
    assert np.allclose(df["buildup"], df["m"])
    noisy = rng.laplace(size=(4, 2, D))
    with open_capture(_capture(tmp_path, noisy, name="noisy")) as cap:
        df = buildup(cap, Selection.of(cap, steps=[1]), BuildupParams([0.05]))
    k = k_for(0.05, D)
    sets = [_topk(noisy[i, 1], k) for i in range(4)]
    last = df[df["m"] == 4].iloc[0]
    assert last["union"] == pytest.approx(reduce(np.union1d, sets).size)
    assert last["density"] == pytest.approx(last["union"] / D)
    assert last["random_union"] == pytest.approx(D * (1 - (1 - k / D) ** 4))
    assert last["allgather_vs_allreduce"] == pytest.approx(4 * k / D)


def test_temporal_overlap_matches_numpy_sets(tmp_path):
    rng = np.random.default_rng(1)
    drift = np.cumsum(rng.laplace(size=(1, 5, D)), axis=1)
    grads = drift + 0.3 * rng.laplace(size=(2, 5, D))
    path = _capture(tmp_path, grads, steps=[0, 10, 20, 30, 40])
    with open_capture(path) as cap:
        df = overlap(cap, Selection.of(cap), OverlapParams(0.05, lag=2))
    k = k_for(0.05, D)
    assert sorted(set(zip(df["step"], df["next_step"], strict=True))) == [
        (0, 20),
        (10, 30),
        (20, 40),
    ]
    assert set(df["gap"]) == {20}
    for row in df.itertuples():
        i, j = row.step // 10, row.next_step // 10
        a = grads[:, i].mean(axis=0) if row.learner == "mean" else grads[row.learner, i]
        b = grads[:, j].mean(axis=0) if row.learner == "mean" else grads[row.learner, j]
        inter = np.intersect1d(_topk(a, k), _topk(b, k)).size
        assert row.overlap == pytest.approx(inter / k)


def test_ef_vectors_replay_matches_a_numpy_loop(tmp_path):
    rng = np.random.default_rng(2)
    grads = rng.laplace(size=(2, 4, D)).astype(np.float32)
    path = _capture(tmp_path, grads)
    ratio, k = 0.05, k_for(0.05, D)
    with open_capture(path) as cap:
        out = dict(ef_vectors(cap, [1, 3], [0, 1], cap.scopes("model"), [ratio]))
    assert sorted(out) == [1, 3]
    memory = np.zeros((2, D), dtype=np.float32)
    for step in range(4):
        p = grads[:, step] + memory
        if step in out:
            np.testing.assert_allclose(out[step]["model", ratio].numpy(), p, rtol=1e-6)
        sent = np.zeros_like(p)
        for i in range(2):
            keep = _topk(p[i], k)
            sent[i, keep] = p[i, keep]
        memory = p - sent


def test_similarity_cli_json_csv_plot(synthetic_capture, tmp_path, capsys):
    path, _ = synthetic_capture
    csv, plot = tmp_path / "sim.csv", tmp_path / "sim.png"
    code, out, err = run(
        capsys, "similarity", path, "--ratio", "0.05", "--json", "--csv", csv, "--plot", plot
    )
    assert code == 0, err
    doc = json.loads(out)
    records = pd.DataFrame(doc["records"])
    for column in ("step", "scope", "ratio", "learner_a", "learner_b", "overlap", "jaccard"):
        assert column in records
    assert set(records["learner_b"]) == {1, 2, "mean"}
    assert len(records) == 6 * (3 + 3)
    assert len(doc["steps"]) == 6 and len(doc["summary"]) == 1
    assert doc["summary"][0]["overlap_vs_random"] > 5  # the shared component shows
    assert len(pd.read_csv(csv)) == len(records)
    assert plot.stat().st_size > 10_000
    code, out, err = run(capsys, "similarity", path, "--ratio", "0.05", "--on", "ef", "--detail")
    assert code == 0, err
    assert "top-k similarity per step" in out and "on ef" in out


def test_buildup_and_overlap_cli(synthetic_capture, tmp_path, capsys):
    path, _ = synthetic_capture
    plot = tmp_path / "b.svg"
    code, out, err = run(capsys, "buildup", path, "--ratios", "0.05,0.01", "--json", "--plot", plot)
    assert code == 0, err
    records = pd.DataFrame(json.loads(out)["records"])
    for column in ("step", "scope", "ratio", "m", "union", "buildup", "random_buildup"):
        assert column in records
    assert len(records) == 6 * 2 * 3
    assert plot.read_text().startswith("<?xml")
    code, out, err = run(capsys, "overlap", path, "--ratio", "0.05", "--lag", "2", "--json")
    assert code == 0, err
    records = pd.DataFrame(json.loads(out)["records"])
    for column in ("step", "next_step", "learner", "ratio", "overlap"):
        assert column in records
    assert len(records) == 4 * 4
    code, out, err = run(capsys, "overlap", path, "--ratios", "0.05", "--steps", "0:6:2", "--json")
    assert code == 0, err
    assert {row["gap_max"] for row in json.loads(out)["summary"]} == {2}
    code, out, err = run(capsys, "buildup", path, "--scope", "layers", "--ratios", "0.95")
    assert code == 0, err
    assert "Warning:" in err and "conv.bias" in err  # k >= numel: that layer is skipped


def test_bad_input_is_one_clean_error(synthetic_capture, tmp_path, capsys):
    path, grads = synthetic_capture
    with open_capture(path) as cap:
        single = write_capture(tmp_path / "single", grads[:1], cap.layers)
    assert_error(run(capsys, "similarity", single), "at least 2 learners")
    assert_error(run(capsys, "buildup", single), "at least 2 learners")
    assert_error(run(capsys, "similarity", path, "--learners", "1"), "at least 2")
    assert_error(run(capsys, "similarity", path, "--steps", "99"), "step 99")
    assert_error(run(capsys, "similarity", path, "--scope", "conv.bias", "--ratio", "0.95"), "k=8")
    assert_error(run(capsys, "similarity", path, "--ratio", "1.5"), "strictly between 0 and 1")
    assert_error(run(capsys, "buildup", path, "--ratios", "0.1,x"))
    assert_error(run(capsys, "similarity", path, "--on", "dense"))
    assert_error(run(capsys, "overlap", path, "--lag", "6"), "lag=6")
    assert_error(run(capsys, "similarity", path, "--plot", tmp_path / "fig.jpg"), "suffix")
    assert_error(run(capsys, "overlap", tmp_path / "missing"))
    assert run(capsys, "overlap", single, "--ratio", "0.05")[0] == 0  # one learner is enough


def test_ef_with_gaps_warns(tmp_path, capsys):
    grads = np.random.default_rng(3).laplace(size=(2, 3, D))
    path = _capture(tmp_path, grads, steps=[0, 5, 10])
    code, _, err = run(capsys, "similarity", path, "--ratio", "0.05", "--on", "ef")
    assert code == 0, err
    assert "Warning:" in err and "gaps up to 5" in err


def test_ef_with_several_ratios_replays_each_ratio_separately(synthetic_capture):
    path, _ = synthetic_capture
    with open_capture(path) as cap:
        everything = Selection.of(cap)
        both = buildup(cap, everything, BuildupParams([0.05, 0.2], on="ef"))
        for ratio in (0.05, 0.2):
            alone = buildup(cap, everything, BuildupParams([ratio], on="ef"))
            pd.testing.assert_frame_equal(
                both[both["ratio"] == ratio].reset_index(drop=True), alone
            )
        raw = buildup(cap, everything, BuildupParams([0.05]))
    assert not np.allclose(raw["union"], both[both["ratio"] == 0.05]["union"])


def test_too_sparse_vectors_warn(tmp_path, capsys):
    grads = np.zeros((2, 2, D))
    grads[:, :, 204:209] = np.random.default_rng(4).normal(size=(2, 2, 5))  # 5 non-zeros
    path = _capture(tmp_path, grads)
    code, _, err = run(capsys, "similarity", path, "--scope", "b.weight", "--ratio", "0.1")
    assert code == 0, err
    assert "Warning:" in err and "fewer than k=30 non-zero" in err


def test_analyses_import_no_cli_or_plotting():
    code = (
        "import sys, gradstat.analysis.similarity, gradstat.analysis.buildup, "
        "gradstat.analysis.overlap; "
        "heavy = ('typer', 'rich', 'matplotlib', 'seaborn', 'numba'); "
        "print([m for m in heavy if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_real_capture_overlaps_far_above_random(real_capture):
    """ScaleCom's observation on real training: local top-k sets overlap far above k/d."""
    with open_capture(real_capture) as cap:
        result = similarity(cap, Selection.of(cap), SimilarityParams(0.01))
    steps = result.steps
    assert (steps["mean_overlap"] > 5 * steps["random_overlap"]).all()
    assert (steps["mean_overlap_global"] > 5 * steps["random_overlap"]).all()
    assert (steps["buildup"] < steps["random_buildup"]).all()
