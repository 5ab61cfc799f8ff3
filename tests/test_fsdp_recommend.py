"""recommend on an FSDP2 capture: the dense baseline is FSDP's reduce-scatter in the run's
reduce dtype plus the parameter all-gather (cost model, gradstat/compressors/cost.py),
the candidates are those with a reduce-scatter form, replayed per FSDP unit, and the
answer names the collective, the format and what was left out."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gradstat.analysis.recommend import RecommendParams, recommend
from gradstat.compressors.cost import (
    Link,
    allgather_seconds,
    allreduce_seconds,
    reducescatter_seconds,
)
from gradstat.compressors.targets import builtin_target
from gradstat.errors import UsageError
from gradstat.store import layer_table, open_capture, write_capture

LAYERS = layer_table([("a.w", (30, 20)), ("a.b", (30,)), ("b.w", (10, 30)), ("head", (10,))])
UNITS = [
    {"name": "a", "layers": [0, 1], "shard": 2, "replicate": 1, "reduce_dtype": "bfloat16"},
    {"name": "(root)", "layers": [2, 3], "shard": 2, "replicate": 1, "reduce_dtype": "bfloat16"},
]
LINK = Link(1.25e9, 5e-6)


@pytest.fixture
def capture(tmp_path):
    rng = np.random.default_rng(3)
    d = LAYERS[-1].stop
    grads = (rng.normal(size=(1, 3, d)) + 0.3 * rng.normal(size=(2, 3, d))).astype(np.float32)
    meta = {"data_parallel": "fsdp2", "fsdp_units": json.dumps(UNITS)}
    return write_capture(tmp_path / "cap", grads, LAYERS, meta=meta)


def test_fsdp_baseline_candidates_and_answer(capture):
    params = RecommendParams(
        error_budget=0.01,
        link=LINK,
        cost_learners=4,
        compressors="bf16,fp8-e4m3:algorithm=a2a,topk,randomk",
        ratios="0.1",
    )
    with open_capture(capture) as cap:
        result = recommend(cap, params=params)
    numel = LAYERS[-1].stop
    gather = allgather_seconds(numel * 2 / 4, 4, LINK)
    assert result.baseline == "bf16"
    assert result.baseline_seconds == pytest.approx(
        reducescatter_seconds(numel * 2, 4, LINK) + gather
    )
    assert set(result.ranking["compressor"]) == {
        "bf16:algorithm=ring:accumulate=fp32",
        "fp8-e4m3:algorithm=a2a:accumulate=fp32",
        "randomk",
    }
    assert result.left_out == ("topk",)
    assert result.plan == "unit (2 messages)"
    text = " ".join(result.explanation())
    assert "FSDP2 ring reduce-scatter + parameter all-gather" in text
    assert "have no reduce-scatter form (left out: topk)" in text
    # fp8 in a reduce-scatter per unit (each unit's 2 chunks: a byte a value and a
    # scale), plus the parameter all-gather that every candidate pays too
    fp8 = result.ranking[result.ranking.compressor.str.startswith("fp8")].iloc[0]
    assert fp8["bytes_per_learner"] == (315 + 4) * 2 + (155 + 4) * 2
    scatter = 2 * 3 * LINK.latency + 3 / 4 * fp8["bytes_per_learner"] / LINK.bandwidth
    assert fp8["comm_seconds"] == pytest.approx(scatter + gather)


def test_only_sparse_all_gather_candidates_is_a_usage_error(capture):
    params = RecommendParams(error_budget=0.01, link=LINK, compressors="topk,dgc", ratios="0.1")
    with open_capture(capture) as cap, pytest.raises(UsageError, match="left out: topk, dgc"):
        recommend(cap, params=params)


def test_hsdp_baseline_and_candidates_run_in_shard_groups(tmp_path):
    # HSDP 2 x 2: each unit's gradient is reduce-scattered within 2 learners, then each
    # shard all-reduced over the 2 replicas; the candidates run in the reduce-scatter of
    # their shard group (one hop per unit) and pay the same all-reduce and all-gather
    units = [dict(unit, shard=2, replicate=2) for unit in UNITS]
    rng = np.random.default_rng(4)
    d = LAYERS[-1].stop
    grads = rng.normal(size=(4, 2, d)).astype(np.float32)
    meta = {"data_parallel": "fsdp2", "fsdp_units": json.dumps(units)}
    path = write_capture(tmp_path / "cap", grads, LAYERS, meta=meta)
    params = RecommendParams(error_budget=1.0, link=LINK, compressors="fp8-e4m3", ratios="0.1")
    with open_capture(path) as cap:
        result = recommend(cap, params=params)
    part = d * 2 / 2  # a bf16 shard of each learner's group of 2
    fixed = allreduce_seconds(part, 2, LINK) + allgather_seconds(part, 2, LINK)
    assert result.baseline_seconds == pytest.approx(reducescatter_seconds(d * 2, 2, LINK) + fixed)
    fp8 = result.ranking.iloc[0]
    scatter = 2 * LINK.latency + 1 / 2 * fp8["bytes_per_learner"] / LINK.bandwidth
    assert fp8["comm_seconds"] == pytest.approx(scatter + fixed)
    text = " ".join(result.explanation())
    assert "HSDP ring reduce-scatter + replicate all-reduce + parameter all-gather" in text


def test_hsdp_candidates_pay_their_compressed_replicate_stage(tmp_path):
    # gradstat's own --hsdp with a compressor (units record replicate_compressed): the
    # baseline keeps FSDP's dense replicate all-reduce, a candidate pays its own stage 2
    # instead, over the 2 replicas; priced at 8 learners (shard groups of 4)
    rng = np.random.default_rng(5)
    d = LAYERS[-1].stop
    grads = rng.normal(size=(4, 2, d)).astype(np.float32)
    params = RecommendParams(
        error_budget=1.0,
        link=LINK,
        cost_learners=8,
        compressors="fp8-e4m3",
        ratios="0.1",
        target=builtin_target("a100"),  # the work model: no timing on this machine
    )

    def recommended(compressed: bool):
        units = [
            dict(
                unit, shard=2, replicate=2, reduce_dtype="float32", replicate_compressed=compressed
            )
            for unit in UNITS
        ]
        meta = {"data_parallel": "fsdp2", "fsdp_units": json.dumps(units)}
        path = write_capture(tmp_path / f"cap{compressed}", grads, LAYERS, meta=meta)
        with open_capture(path) as cap:
            return recommend(cap, params=params)

    dense, both = recommended(False), recommended(True)
    part = d * 4 / 4  # a float32 shard of each learner's group of 4
    replicate = allreduce_seconds(part, 2, LINK)
    gather = allgather_seconds(part, 4, LINK)
    base = reducescatter_seconds(d * 4, 4, LINK) + replicate + gather
    assert dense.baseline_seconds == pytest.approx(base)
    assert both.baseline_seconds == pytest.approx(base)
    stage1 = dense.ranking.iloc[0]["bytes_per_learner"]  # one reduce-scatter per unit
    stage2 = both.ranking.iloc[0]["bytes_per_learner"] - stage1  # one all-reduce per unit
    assert stage2 > 0
    scatter = 2 * 3 * LINK.latency + 3 / 4 * stage1 / LINK.bandwidth
    assert dense.ranking.iloc[0]["comm_seconds"] == pytest.approx(scatter + replicate + gather)
    replicas = allreduce_seconds(stage2, 2, LINK) + allreduce_seconds(0, 2, LINK)
    assert both.ranking.iloc[0]["comm_seconds"] == pytest.approx(scatter + replicas + gather)
