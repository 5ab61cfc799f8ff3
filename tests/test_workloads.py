"""The built-in workloads: model shapes against the papers' models, data, real captures."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from gradstat import open_capture
from gradstat.capture.workloads import (
    SIZE_NAMES,
    build_workload,
    parameter_count,
    workload_names,
)
from gradstat.capture.workloads.lstm import word_tokens
from gradstat.capture.workloads.resnet import ResNet, torchvision_resnet50
from tests.helpers import TESTS, assert_clean_error, run_cli, torchrun

REFERENCE_SCRIPT = TESTS / "ddp_reference_train.py"


def _gpt2_parameters(blocks: int, width: int, vocab: int, context: int) -> int:
    """GPT-2's parameters counted by hand: per block two LayerNorms (2 x 2w), attention
    (w x 3w + 3w, w x w + w), MLP (w x 4w + 4w, 4w x w + w); embeddings; final norm; the
    output layer is tied to the token embedding."""
    per_block = 2 * 2 * width + (3 * width * width + 3 * width) + (width * width + width)
    per_block += (4 * width * width + 4 * width) + (4 * width * width + width)
    return blocks * per_block + vocab * width + context * width + 2 * width


def _lstm_parameters(vocab: int, hidden: int, layers: int = 2) -> int:
    """Embedding, per layer 4 gates x (input + recurrent weights + two biases), decoder."""
    per_layer = 4 * hidden * (hidden + hidden) + 2 * 4 * hidden
    return vocab * hidden + layers * per_layer + hidden * vocab + vocab


@pytest.mark.parametrize(
    "name, expected",
    [
        ("resnet50", 23_528_522),  # torchvision.models.resnet50(num_classes=10)
        ("gpt2", _gpt2_parameters(12, 768, vocab=256, context=128)),  # 85,350,912
        ("lstm", _lstm_parameters(10_000, 1_500)),  # 66,034,000: Zaremba et al.'s large
    ],
)
def test_default_sizes_are_the_papers_models(name, expected):
    assert parameter_count(name) == expected
    assert parameter_count(name, "large") == expected


def test_every_size_of_every_workload_grows():
    for name in workload_names():
        counts = [parameter_count(name, size) for size in SIZE_NAMES]
        assert counts == sorted(counts) and len(set(counts)) == len(counts), (name, counts)


def test_resnet50_is_torchvisions_architecture():
    """Names, shapes and order as torchvision's resnet50 (checked against torchvision
    0.28 itself when this file was written; compared live where torchvision imports)."""
    with torch.device("meta"):
        model = ResNet((3, 4, 6, 3), num_classes=10)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert len(shapes) == 161
    assert shapes["conv1.weight"] == (64, 3, 7, 7)
    assert shapes["layer1.0.downsample.0.weight"] == (256, 64, 1, 1)
    assert shapes["layer2.0.conv2.weight"] == (128, 128, 3, 3)  # stride on the 3x3 (v1.5)
    assert shapes["layer4.2.conv3.weight"] == (2048, 512, 1, 1)
    assert shapes["fc.weight"] == (10, 2048)
    assert [name for name in shapes if "downsample.0" in name] == [
        f"layer{i}.0.downsample.0.weight" for i in range(1, 5)
    ]
    assert model.layer2[0].conv2.stride == (2, 2) and model.layer2[0].conv1.stride == (1, 1)
    reference = torchvision_resnet50()
    if reference is not None:
        assert shapes == {name: tuple(p.shape) for name, p in reference.named_parameters()}


def test_word_tokens_rank_by_frequency_with_unknown_words_as_zero():
    tokens, vocab = word_tokens(b"a b a c a b d(", vocab=3)
    # most frequent: a (3), b (2); c, d and "(" are unknown
    assert vocab == 3
    assert tokens.tolist() == [1, 2, 1, 0, 1, 2, 0, 0]


@pytest.mark.parametrize("name", ["resnet50", "gpt2", "lstm"])
def test_batches_differ_between_learners_and_fit_the_model(name):
    workload = build_workload(name, "tiny")
    first = next(workload.batches(0, 2, 4, 0))
    second = next(workload.batches(1, 2, 4, 0))
    assert not torch.equal(first[0], second[0])
    loss = workload.loss(workload.model(first[0]), first[1])
    assert loss.ndim == 0 and torch.isfinite(loss)


def test_text_workloads_read_data_files(tmp_path):
    text = tmp_path / "words.txt"
    text.write_text("the cat sat on the mat . " * 200)
    workload = build_workload("lstm", "tiny", text)
    assert "7 words" in workload.description  # 6 distinct words + <unk>
    assert "words.txt" in build_workload("gpt2", "tiny", text).description


REAL = ["resnet50", "gpt2", "lstm"]


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory):
    """2 steps of each REAL workload (tiny), one after another in one torchrun launch."""
    out = tmp_path_factory.mktemp("workloads")
    runs = [["--out", str(out / name), "--workload", name, "--steps", "2"] for name in REAL]
    result = torchrun(REFERENCE_SCRIPT, "--runs", json.dumps(runs), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return out


@pytest.mark.parametrize("name", REAL)
def test_real_gloo_capture_mean_is_the_allreduced_gradient(real_runs, name):
    reference = np.load(real_runs / name / "reference-rank0.npy")
    with open_capture(real_runs / name) as cap:
        assert cap.status == "complete" and cap.numel == parameter_count(name, "tiny")
        for row, (_step, grads) in enumerate(cap.iter_steps()):
            np.testing.assert_allclose(grads.mean(0).numpy(), reference[row], rtol=1e-4, atol=1e-6)
            assert not np.allclose(grads[0].numpy(), grads[1].numpy()), "learners must differ"


def test_list_workloads_fits_80_columns(capsys):
    result = run_cli(capsys, "capture", "--list-workloads")
    assert result.code == 0
    lines = result.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), lines
    for name in workload_names():
        assert any(line.startswith(name + " ") for line in lines), name
    assert "23,528,522" in result.stdout and "66,034,000" in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--workload", "resnet50", "--data", "x.txt"], "text workloads only"),
        (["--workload", "gpt2", "--size", "huge"], "unknown --size"),
    ],
)
def test_workload_options_are_checked_before_launch(tmp_path, capsys, args, message):
    result = run_cli(capsys, "capture", "--out", tmp_path / "x", *args)
    assert_clean_error(result, code=2)
    assert message in result.stderr


@pytest.mark.slow
def test_resnet50_capture_two_learners_two_steps(tmp_path, capsys):
    out = tmp_path / "resnet50"
    result = run_cli(
        capsys, "capture", "--workload", "resnet50", "--steps", "2", "--batch-size", "4",
        "--out", out,
    )  # fmt: skip
    assert result.code == 0, result
    with open_capture(out) as cap:
        assert cap.status == "complete" and len(cap.steps) == 2 and len(cap.learners) == 2
        assert cap.numel == 23_528_522
