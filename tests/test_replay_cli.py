"""``gradstat replay`` and ``gradstat recommend`` end to end, in process, on captures with
known contents."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from gradstat.analysis.buildup import BuildupParams, buildup
from gradstat.analysis.replay import ReplayParams, replay
from gradstat.analysis.selection import Selection
from gradstat.compressors.cost import Link, allgather_seconds, allreduce_seconds
from gradstat.store import layer_table, open_capture, write_capture
from tests.helpers import assert_clean_error, run_cli

LINK = Link(1.25e9, 5e-6)  # the defaults: 10Gbit/s, 5us
REQUIRED = {
    "compressor",
    "ratio",
    "step",
    "density",
    "quality",
    "buildup",
    "bytes_per_learner",
    "comm_seconds",
    "rel_error",
    "cosine",
    "compress_seconds",
}


def replay_json(capsys, path, *args) -> dict:
    result = run_cli(capsys, "replay", path, "--json", *args)
    assert result.code == 0, result.stderr
    return json.loads(result.stdout)


def test_replay_json_records_match_brute_force(capsys, synthetic_capture):
    path, grads = synthetic_capture
    n, steps, d = grads.shape
    doc = replay_json(capsys, path, "--compressors", "topk,fp16,clt-k", "--ratios", "0.1,0.01")
    records = pd.DataFrame(doc["records"])
    assert set(records.columns) >= REQUIRED
    assert len(records) == steps * (2 + 1 + 2)
    assert records.loc[records["compressor"] == "fp16", "ratio"].isna().all()
    top = records[(records["compressor"] == "topk") & (records["ratio"] == 0.1)]
    k = round(0.1 * d)
    assert (top["bytes_per_learner"] == k * 8).all()
    assert top["density"].to_numpy() == pytest.approx(k / d)
    assert top["comm_seconds"].to_numpy() == pytest.approx(allgather_seconds(k * 8, n, LINK))
    # step 0: empty memories, so the estimate is the mean of the learners' top-k vectors
    g = grads[:, 0].astype(np.float64)
    kept = np.zeros_like(g)
    for i in range(n):
        idx = np.argsort(-np.abs(g[i]))[:k]
        kept[i, idx] = g[i, idx]
    mean, estimate = g.mean(0), kept.mean(0)
    first = top.iloc[0]
    assert first["rel_error"] == pytest.approx(
        np.sum((estimate - mean) ** 2) / np.sum(mean**2), rel=1e-5
    )
    assert first["cosine"] == pytest.approx(
        estimate @ mean / np.linalg.norm(estimate) / np.linalg.norm(mean), rel=1e-5
    )
    assert first["union"] == len(set(np.nonzero(kept)[1]))
    fp16 = records[records["compressor"] == "fp16"]
    assert (fp16["rel_error"] < 1e-6).all() and (fp16["bytes_per_learner"] == 2 * d).all()
    assert fp16["comm_seconds"].to_numpy() == pytest.approx(allreduce_seconds(2 * d, n, LINK))
    clt = records[records["compressor"] == "clt-k"]
    assert (clt["buildup"] == 1).all() and (clt["quality"] == 1).all()
    summary = pd.DataFrame(doc["summary"])
    assert len(summary) == 5 and doc["learners"] == n


def test_topk_allgather_union_equals_gradstat_buildup(synthetic_capture):
    """The union a top-k replay all-gathers is B(n) * k of `gradstat buildup --on ef`."""
    path, grads = synthetic_capture
    with open_capture(path) as cap:
        everything = Selection.of(cap)
        records = replay(cap, everything, ReplayParams("topk", "0.05,0.2", LINK))
        built = buildup(cap, everything, BuildupParams([0.05, 0.2], on="ef"))
    full = built[built["m"] == grads.shape[0]]
    for ratio in (0.05, 0.2):
        ours = records[records["ratio"] == ratio].set_index("step")["union"]
        theirs = full[full["ratio"] == ratio].set_index("step")["union"]
        assert ours.to_dict() == theirs.to_dict()


def test_replay_on_a_real_capture(capsys, real_capture):
    doc = replay_json(
        capsys, real_capture, "--compressors", "topk,sidco-exp,powersgd:rank=1", "--ratios", "0.01"
    )
    records = pd.DataFrame(doc["records"])
    assert set(records["compressor"]) == {"topk", "sidco-exp", "powersgd:rank=1"}
    assert records["cosine"].between(-1, 1).all()
    assert (records["rel_error"] >= 0).all()
    power = records[records["compressor"] == "powersgd:rank=1"]
    assert (power["bytes_per_learner"] < power["numel"] * 4).all()


def test_replay_tables_csv_and_plot(capsys, synthetic_capture, tmp_path):
    path, _ = synthetic_capture
    csv, plot = tmp_path / "r.csv", tmp_path / "r.png"
    result = run_cli(
        capsys,
        "replay",
        path,
        "--compressors",
        "topk,ef-signsgd",
        "--ratios",
        "0.1,0.01",
        "--csv",
        csv,
        "--plot",
        plot,
        "--steps",
        "0:3",
    )
    assert result.code == 0, result.stderr
    assert "topk" in result.stdout and "ef-signsgd" in result.stdout
    assert "speed-up" in result.stdout
    table = pd.read_csv(csv)
    assert len(table) == 3 * (2 + 1) and set(table.columns) >= REQUIRED
    assert plot.stat().st_size > 1000


def test_replay_layers_scope_skips_what_cannot_run(capsys, synthetic_capture):
    path, _ = synthetic_capture
    result = run_cli(
        capsys,
        "replay",
        path,
        "--json",
        "--scope",
        "layers",
        "--compressors",
        "topk,powersgd",
        "--ratios",
        "0.2",
    )
    assert result.code == 0, result.stderr
    records = pd.DataFrame(json.loads(result.stdout)["records"])
    assert set(records["scope"]) == {"conv.weight", "conv.bias", "fc.weight"}
    powersgd = records[records["compressor"] == "powersgd"]
    assert set(powersgd["scope"]) == {"fc.weight"}  # 10x50 at rank 4; 8x9 and 8 are not worth it
    assert "skipped 2" in result.stderr


def test_the_default_compressors_skip_what_cannot_run_a_named_one_fails(capsys, tmp_path):
    """A model of vectors only: the default set skips PowerSGD with one warning and
    replays the rest; asked for by name, PowerSGD fails with one clean error."""
    rng = np.random.default_rng(3)
    grads = rng.laplace(size=(2, 3, 4000)).astype(np.float32)
    layers = layer_table([("a.bias", (1000,)), ("b.bias", (3000,))])
    path = write_capture(tmp_path / "vectors", grads, layers)
    result = run_cli(capsys, "replay", path, "--json", "--ratios", "0.01")
    assert result.code == 0, result.stderr
    records = pd.DataFrame(json.loads(result.stdout)["records"])
    assert set(records["compressor"]) == {"topk", "dgc", "sidco-gpd", "clt-k"}
    assert "skipped 1" in result.stderr and "powersgd" in result.stderr
    named = run_cli(capsys, "replay", path, "--compressors", "topk,powersgd")
    assert_clean_error(named, code=2)
    assert "powersgd at rank 4 compresses no parameter" in named.stderr


def test_gaps_warn(capsys, tmp_path):
    layers = layer_table([("w", (10, 10))])
    grads = np.random.default_rng(0).normal(size=(2, 4, 100)).astype(np.float32)
    path = write_capture(tmp_path / "gappy", grads, layers, steps=[0, 1, 5, 6])
    result = run_cli(capsys, "replay", path, "--compressors", "topk", "--ratios", "0.1")
    assert result.code == 0
    assert "gap" in result.stderr and "1 -> 5" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--compressors", "topk,zip"], "unknown compressor 'zip'"),
        (["--ratios", "1.5"], "strictly between 0 and 1"),
        (["--granularity", "layers"], "choose model, tensor, bucket"),
        (["--dense", "("], "not a valid regex"),
        (["--bandwidth", "fast"], "--bandwidth 'fast'"),
        (["--latency", "soon"], "--latency 'soon'"),
        (["--plot", "out.gif"], "suffix"),
        (["--compressors", "clt-k:beta=2"], "beta must be in"),
        (["--steps", "99"], "not recorded"),
    ],
)
def test_replay_bad_input(capsys, synthetic_capture, args, message):
    path, _ = synthetic_capture
    result = run_cli(capsys, "replay", path, *args)
    assert_clean_error(result, 2)
    assert message in result.stderr


@pytest.fixture
def sparse_capture(tmp_path):
    """4 learners whose gradients have the same 20 non-zeros of 2000 at every step: top-k at
    ratio 0.01 (k = 20) is exact, so it must win any budget on a slow network."""
    rng = np.random.default_rng(3)
    support = rng.choice(2000, size=20, replace=False)
    grads = np.zeros((4, 5, 2000), dtype=np.float32)
    grads[:, :, support] = rng.normal(size=(4, 5, 20)) + 3.0
    layers = layer_table([("w", (40, 50))])
    return write_capture(tmp_path / "sparse", grads, layers)


def test_recommend_picks_the_clear_winner(capsys, sparse_capture, tmp_path):
    out = tmp_path / "config.json"
    args = ["--compressors", "topk,fp16,qsgd,randomk", "--ratios", "0.01,0.1"]
    slow = ["--bandwidth", "1Mbit/s", "--latency", "0us", "--error-budget", "0.05"]
    result = run_cli(capsys, "recommend", sparse_capture, *args, *slow, "--out", out)
    assert result.code == 0, result.stderr
    assert "topk" in result.stdout and "Next:" in result.stdout
    config = json.loads(out.read_text())
    winner = config["recommendation"]
    assert (winner["compressor"], winner["ratio"]) == ("topk", 0.01)
    assert winner["rel_error"] == pytest.approx(0.0, abs=1e-12)
    assert winner["settings"]["k"] == 20
    assert config["pays_off"] is True
    assert config["baseline_seconds"] == pytest.approx(allreduce_seconds(8000, 4, Link(125e3, 0)))
    # --cluster-size extrapolates the cost model only. On 64 learners the all-gather of 20
    # 8-byte pairs (63 * 160 B) moves more than a fp16 ring all-reduce (2 * 63/64 * 4000 B)
    result = run_cli(
        capsys, "recommend", sparse_capture, *args, *slow, "--cluster-size", "64", "--json"
    )
    doc = json.loads(result.stdout)
    assert doc["cost_learners"] == 64 and doc["learners"] == 4
    candidates = {(c["compressor"], c["ratio"]): c for c in doc["candidates"]}
    link = Link(125e3, 0)
    assert candidates["topk", 0.01]["comm_seconds"] == pytest.approx(
        allgather_seconds(160, 64, link)
    )
    assert doc["recommendation"]["compressor"] == "fp16:algorithm=ring:accumulate=fp32"
    assert doc["recommendation"]["comm_seconds"] == pytest.approx(allreduce_seconds(4000, 64, link))


def test_recommend_keeps_dense_when_the_network_is_fast(capsys, sparse_capture):
    result = run_cli(
        capsys,
        "recommend",
        sparse_capture,
        "--compressors",
        "topk",
        "--ratios",
        "0.01",
        "--bandwidth",
        "10TB/s",
        "--latency",
        "0us",
        "--error-budget",
        "0.1",
        "--baseline",
        "fp16",
        "--json",
    )
    assert result.code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["pays_off"] is False and doc["baseline"] == "fp16"
    assert doc["steps"] == [0, 1, 2, 3, 4]
    assert any("does not beat" in line for line in doc["explanation"])


def test_recommend_budget_nobody_meets(capsys, synthetic_capture):
    path, _ = synthetic_capture
    result = run_cli(
        capsys,
        "recommend",
        path,
        "--compressors",
        "topk,randomk",
        "--ratios",
        "0.01,0.1",
        "--error-budget",
        "1e-9",
    )
    assert_clean_error(result, 1)
    assert "closest is topk 0.1" in result.stderr
    assert "randomk" in result.stdout  # the ranking is still shown


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--error-budget", "-1"], "error_budget"),
        (["--error-budget", "0.2", "--baseline", "fp8"], "fp8"),
        (["--error-budget", "0.2", "--cluster-size", "1"], "2 or more"),
        (["--error-budget", "0.2", "--bandwidth", "10 apples/s"], "--bandwidth"),
        (["--error-budget", "0.2", "--out", "/nonexistent/dir/c.json"], "does not exist"),
    ],
)
def test_recommend_bad_input(capsys, synthetic_capture, args, message):
    path, _ = synthetic_capture
    result = run_cli(capsys, "recommend", path, "--compressors", "topk", *args)
    assert_clean_error(result, 2)
    assert message in result.stderr


def test_replay_selected_learners_set_the_cost_model(capsys, synthetic_capture):
    path, grads = synthetic_capture
    d = grads.shape[2]
    doc = replay_json(capsys, path, "--compressors", "fp16", "--learners", "0,2", "--steps", "3")
    (record,) = doc["records"]
    assert doc["learners"] == 2 and record["step"] == 3
    assert record["comm_seconds"] == pytest.approx(allreduce_seconds(2 * d, 2, LINK))
    g0, g1 = grads[[0, 2], 3]
    mean = ((g0 + g1) / 2).astype(np.float64)  # the replay's reference, in float32
    # fp16's default collective, a ring with float32 sums over 2 learners: each owner
    # adds the other's chunk, rounded, to its own; the all-gather rounds the sum once
    c = -(-d // 2)
    h = lambda v: v.astype(np.float16).astype(np.float32)  # noqa: E731
    total = np.concatenate([h(h(g1[:c]) + g0[:c]), h(h(g0[c:]) + g1[c:])])
    half = (total / np.float32(2)).astype(np.float64)
    assert record["rel_error"] == pytest.approx(np.sum((half - mean) ** 2) / np.sum(mean**2))


def test_detail_adds_a_record_per_message_whose_sums_are_the_steps(capsys, synthetic_capture):
    """--json keeps one record per (step, compressor, ratio) at the scope with the whole
    step's totals; --detail adds one per message (here each of the 3 tensors, and the
    parameters of fewer than 50 values sent dense): bytes and values sent add up, and
    the step's error is that of the whole model's aggregate."""
    path, grads = synthetic_capture
    args = ["replay", path, "--compressors", "topk", "--ratios", "0.05", "--json"]
    plain = run_cli(capsys, *args, "--granularity", "tensor")
    detail = run_cli(capsys, *args, "--granularity", "tensor", "--detail", "--dense-below", "50")
    assert plain.code == detail.code == 0, detail.stderr
    totals = pd.DataFrame(json.loads(plain.stdout)["records"])
    assert totals["message"].isna().all() and len(totals) == grads.shape[1]
    assert set(totals["granularity"]) == {"tensor"}
    records = pd.DataFrame(json.loads(detail.stdout)["records"])
    steps = records[records["message"].isna()]
    messages = records[records["message"].notna()]
    assert set(messages["message"]) == {"conv.weight", "conv.bias", "fc.weight"}
    for step, whole in steps.groupby("step"):
        parts = messages[messages["step"] == step]
        assert whole["bytes_per_learner"].item() == pytest.approx(parts["bytes_per_learner"].sum())
        numel = parts["numel"]
        assert whole["density"].item() == pytest.approx((parts["density"] * numel).sum() / 580)
        dense = parts[parts["message"] == "conv.bias"]  # 8 values, sent uncompressed
        assert dense["bytes_per_learner"].item() == 32 and dense["rel_error"].item() < 1e-12
    mean = grads.astype(np.float64).mean(axis=0)
    first = steps.iloc[0]
    assert 0 < first["rel_error"] < 1 and first["numel"] == mean.shape[1]
