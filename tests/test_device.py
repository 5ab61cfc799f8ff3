"""``--device``: the same records on every device (CPU here; a GPU where one is present,
e.g. through benchmarks/gpu_check.sh), and a clean error for a device that is missing."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from gradstat.analysis.buildup import BuildupParams, buildup
from gradstat.analysis.compute import Compute
from gradstat.analysis.fit import FitParams, fit
from gradstat.analysis.overlap import OverlapParams, overlap
from gradstat.analysis.replay import ReplayParams, replay
from gradstat.analysis.selection import Selection
from gradstat.analysis.similarity import SimilarityParams, similarity
from gradstat.compressors.cost import Link
from gradstat.store import open_capture
from tests.helpers import assert_clean_error, run_cli

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here"),
    ),
]


def _records(cap, device: str) -> dict[str, pd.DataFrame]:
    compute = Compute(device=device)
    everything = Selection.of(cap)
    result = similarity(cap, everything, SimilarityParams(0.05), compute=compute)
    return {
        "pairs": result.pairs,
        "steps": result.steps,
        "buildup": buildup(cap, everything, BuildupParams("0.05,0.2"), compute=compute),
        "overlap": overlap(cap, everything, OverlapParams(0.05), compute=compute),
        "fit": fit(
            cap,
            Selection.of(cap, steps=[0, 1]),
            FitParams(dists="gpd,exp", ratios=[0.05], stages=[1, 2], sample=None),
            compute=compute,
        ).drop(columns=["params"]),
        "replay": replay(
            cap, everything, ReplayParams("topk,fp16", [0.05], Link(1e9, 5e-6)), compute=compute
        ).drop(columns=["compress_seconds"]),
    }


@pytest.mark.parametrize("device", DEVICES)
def test_records_equal_the_cpu_records(synthetic_capture, device):
    path, _ = synthetic_capture
    with open_capture(path) as cap:
        reference = _records(cap, "cpu")
        on_device = _records(cap, device)
    for name, frame in reference.items():
        pd.testing.assert_frame_equal(on_device[name], frame, rtol=1e-5, obj=name)


def test_auto_is_cuda_exactly_when_available():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert Compute(device="auto").torch_device().type == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
@pytest.mark.parametrize(
    "command", ["similarity", "buildup", "overlap", "fit", "replay", "recommend", "report"]
)
def test_cuda_without_a_gpu_is_one_clean_error(synthetic_capture, capsys, command, tmp_path):
    path, _ = synthetic_capture
    extra = {"recommend": ["--error-budget", "0.5"], "report": ["-o", str(tmp_path / "r.html")]}
    result = run_cli(capsys, command, path, *extra.get(command, []), "--device", "cuda")
    assert_clean_error(result, 2)
    # the option as typed and what to do, not the library's device='cuda'
    assert "Error: --device cuda: no CUDA GPU here" in result.stderr, result
    assert "use --device cpu" in result.stderr
