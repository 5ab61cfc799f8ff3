"""Target hardware profiles, the compression work model and the build-up extrapolation."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch

from gradstat.analysis.cluster import buildup_model, fit_exponent
from gradstat.compressors.plan import build_plan
from gradstat.compressors.registry import REGISTRY, build_scheme
from gradstat.compressors.spec import parse_compressors
from gradstat.compressors.targets import (
    BUILTIN,
    TARGET_NAMES,
    load_target,
    measure,
    resolve_target,
)
from gradstat.compressors.work import CALIBRATION, Ops, seconds
from gradstat.errors import UsageError
from gradstat.stats.topk_sets import buildup_curve
from gradstat.store import layer_table
from tests.helpers import Result, assert_clean_error, run_cli

H100 = BUILTIN["h100"]


class Built:
    """A scheme's learner-0 compressor and its memory, as the cost model prices them."""

    def __init__(self, name: str, d: int, ratio: float | None) -> None:
        spec = parse_compressors(name)[0]
        ratio = None if spec.fixed_rate else ratio
        plan = build_plan(layer_table([("w", (64, d // 64))]))
        built = build_scheme(spec, ratio, plan, seed=0)
        self.compressor, self.memory = built.compressor(0, 0), built.memory

    def work(self, d: int):
        return self.compressor.work(d, self.memory)


def scheme(name: str, d: int = 4096, ratio: float | None = 0.01) -> Built:
    return Built(name, d, ratio)


def test_builtin_profiles_follow_their_datasheets():
    assert set(TARGET_NAMES) == {"cpu-here", "gpu-here", "v100", "a100", "h100", "h200"}
    # effective bandwidth = 0.85 x datasheet; H200 4.8 TB/s, V100 900 GB/s
    assert BUILTIN["h200"].bandwidth == pytest.approx(0.85 * 4.8e12)
    assert BUILTIN["v100"].bandwidth == pytest.approx(0.85 * 900e9)
    for target in BUILTIN.values():
        assert {"bandwidth", "flops", "topk_rate"} <= set(target.sources)
    # a faster memory makes every bandwidth-bound compressor faster, in proportion
    work = scheme("topk").work(4096).online(8)
    big = Ops(bytes=1e9)
    assert seconds(big, BUILTIN["v100"]) / seconds(big, BUILTIN["h200"]) == pytest.approx(
        4.8e12 / 900e9
    )
    assert seconds(work, BUILTIN["h200"]) < seconds(work, BUILTIN["v100"])


def _parts(s):
    return s.compressor, s.memory


def test_seconds_is_the_stated_formula():
    ops = Ops(bytes=8e9, topk_in=1e9, topk_out=1e6, sort=1e6, compare=2e9, launches=10)
    t = H100
    expected = 10 * t.launch + CALIBRATION * (
        8e9 / t.bandwidth
        + 1e9 / t.topk_rate
        + 1e6 * t.topk_per_selected
        + 1e6 / t.sort_rate
        + 2e9 / t.compare_rate
    )
    assert seconds(ops, t) == pytest.approx(expected)
    # a thin product is memory-bound on a GPU: the max of flops and bytes, not the sum
    mm = Ops(mm_flops=1e9, mm_bytes=4e9)
    assert seconds(mm, t) == pytest.approx(CALIBRATION * 4e9 / t.matmul_bandwidth)


def test_all_gather_decoding_grows_with_the_cluster_and_replay_divides_shared_work():
    topk = scheme("topk")
    work = topk.work(4096)
    k = topk.compressor.k
    # every learner scatters the n received payloads: n k pairs, one batch of launches
    assert work.online(64).bytes - work.online(8).bytes == pytest.approx(56 * k * 12)
    assert work.online(64).launches == work.online(8).launches
    clt = scheme("clt-k")
    clt_work = clt.work(4096)
    # the leader's top-k: every learner waits for it in training
    assert clt_work.online(4).topk_in == 4096
    gtopk = scheme("gtopk")
    tree = gtopk.work(4096)
    assert tree.payloads_online(64) == 6 and tree.payloads_online(1) == 0


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_compressor_has_a_work_model(name):
    s = scheme(name)
    work = s.work(4096)
    t = seconds(work.online(16), H100)
    assert math.isfinite(t) and t >= 0
    if name != "none":
        assert t > 0


def test_target_file_round_trip_and_errors(tmp_path):
    path = tmp_path / "mine.json"
    document = {k: v for k, v in H100.to_dict().items() if k not in ("name", "sources")}
    path.write_text(json.dumps(document))
    loaded = load_target(path)
    assert loaded.name == "mine" and loaded.bandwidth == H100.bandwidth
    del document["flops"]
    path.write_text(json.dumps(document))
    with pytest.raises(UsageError, match="missing flops"):
        load_target(path)
    path.write_text(json.dumps({**H100.to_dict(), "bandwidth": -1}))
    with pytest.raises(UsageError, match="bandwidth must be positive"):
        load_target(path)
    path.write_text("{not json")
    with pytest.raises(UsageError, match="not JSON"):
        load_target(path)
    with pytest.raises(UsageError, match="choose one of"):
        resolve_target("tpu", None)
    with pytest.raises(UsageError, match="not both"):
        resolve_target("h100", path)


def test_measured_profiles_come_from_the_same_operations():
    # cpu-here and gpu-here share one measurement: every rate positive and named by its
    # source
    cpu = measure("cpu", numel=1 << 16)
    assert cpu.name == "cpu-here" and set(cpu.sources) >= {"bandwidth", "topk_rate", "flops"}
    assert all(v > 0 for k, v in cpu.to_dict().items() if k.endswith("rate"))


def test_gpu_here_without_a_gpu_is_a_clean_usage_error(synthetic_capture):
    """``recommend --target gpu-here`` where no GPU is visible (a process started with
    ``CUDA_VISIBLE_DEVICES=""``, as a user hides one) stops with one ``Error:`` line and
    exit 2, never a silent CPU profile."""
    path, _ = synthetic_capture
    argv = [sys.executable, "-m", "gradstat", "recommend", str(path), "--compressors", "topk"]
    argv += ["--error-budget", "0.5"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "COLUMNS": "80"}
    done = subprocess.run(
        [*argv, "--target", "gpu-here"], capture_output=True, text=True, env=env, timeout=120
    )
    assert_clean_error(Result(done.returncode, done.stdout, done.stderr), code=2)
    assert "gpu-here measures a CUDA GPU" in done.stderr


def test_power_law_buildup_is_recovered_and_capped():
    m = np.arange(1, 9, dtype=np.float64)
    assert fit_exponent(1.5 * m**0.6) == pytest.approx(0.6)
    n, d, k = 4, 1000, 10
    hist = [k * n, 0, 0, 0]  # disjoint sets: B(m) = m, capped by d / k = 100
    records = pd.DataFrame({"multiplicity": [hist], "k": [k], "numel": [d]})
    model = buildup_model(records, 500)
    assert model.measured == pytest.approx([1, 2, 3, 4])
    assert model.exponent == pytest.approx(1.0)
    assert model.at_cluster == pytest.approx(100.0)
    assert buildup_model(records.assign(multiplicity=[None]), 64) is None


def test_measured_buildup_is_the_exact_subset_average():
    rng = np.random.default_rng(3)
    n, d, k = 5, 200, 20
    idx = np.stack([rng.choice(d, k, replace=False) for _ in range(n)])

    holders = np.bincount(idx.ravel(), minlength=d)  # how many sets hold each index
    hist = torch.from_numpy(np.bincount(holders, minlength=n + 1)[1:])
    records = pd.DataFrame({"multiplicity": [hist.tolist()], "k": [k], "numel": [d]})
    model = buildup_model(records, n)
    # brute force: every subset of size m, mean union
    from itertools import combinations

    for m in range(1, n + 1):
        unions = [len(set(idx[list(c)].ravel())) for c in combinations(range(n), m)]
        assert model.measured[m - 1] == pytest.approx(np.mean(unions) / k)
    assert buildup_curve(hist, n)[-1] == len(set(idx.ravel()))


def test_recommend_on_a_target_states_its_assumptions(capsys, synthetic_capture):
    path, _ = synthetic_capture
    args = ("recommend", path, "--error-budget", "2", "--compressors", "topk,fp16,clt-k")
    result = run_cli(
        capsys, *args, "--ratios", "0.1", "--cluster-size", "64", "--target", "h100", "--json"
    )
    assert result.code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["target"]["name"] == "h100" and doc["cluster_size"] == 64
    assert doc["link"]["algorithms"]["allgather"] == "ring"
    assert doc["buildup"]["topk at ratio 0.1"]["cluster_size"] == 64
    assert any("h100" in line for line in doc["assumptions"])
    for c in doc["candidates"]:
        assert c["seconds"] == pytest.approx(c["comm_seconds"] + c["compress_seconds"])
    topk = next(c for c in doc["candidates"] if c["compressor"] == "topk")
    s = scheme("topk", d=topk_numel(path), ratio=0.1)
    expected = seconds(s.work(topk_numel(path)).online(64), H100)
    assert topk["compress_seconds"] == pytest.approx(expected)
    shown = run_cli(capsys, *args, "--ratios", "0.1", "--target", "v100")
    assert shown.code == 0 and "Assumed: target: v100" in shown.stdout
    assert_clean_error(run_cli(capsys, *args, "--target", "tpu"), 2)


def topk_numel(path) -> int:
    from gradstat.store import open_capture

    with open_capture(path) as cap:
        return cap.numel
