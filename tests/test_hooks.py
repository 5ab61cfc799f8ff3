"""Compression hooks in real DDP training (2 gloo learners) against the replay.

One torchrun run trains the digits CNN with each compressor's hook for 3 steps and
records ``grad`` and ``sent`` (tests/hooks_train.py). Replaying the recorded gradients
with the same compressor and memory must give the recorded ``sent`` rows (exactly for
deterministic compressors), the update the optimizer applied must be the aggregate of
``sent``, and the bytes the hook put into its collectives must be the replay's.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from gradstat.analysis.replay import scope_shapes
from gradstat.analysis.selection import k_for
from gradstat.compressors.registry import build_scheme
from gradstat.compressors.spec import parse_compressors
from gradstat.errors import UsageError
from gradstat.hooks import compression_hook
from gradstat.store import open_capture
from tests.helpers import TESTS, torchrun
from tests.reference_compressors import Reference

RATIO = 0.05
FAST = [
    "topk",
    "clt-k:beta=0.5",
    "randomk",
    "gtopk",
    "sidco-gpd",
    "threshold",
    "fp16",
    "powersgd:rank=2",
    "signsgd",
    "qsgd",
]
SLOW = [
    "none",
    "bf16",
    "dgc",
    "gaussiank",
    "redsync",
    "sidco-exp",
    "sidco-gamma-gpd",
    "ef-signsgd",
    "terngrad",
]
#: relative rounding of the applied update: casts all-reduce the sum in 16 bits
ROUNDING = {"fp16": 2**-10, "bf16": 2**-7}


def _train(tmp_path_factory, names: list[str]):
    out = tmp_path_factory.mktemp("hooks")
    result = torchrun(
        TESTS / "hooks_train.py",
        "--out",
        str(out),
        "--compressors",
        ",".join(names),
        "--ratio",
        str(RATIO),
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def fast_runs(tmp_path_factory):
    return _train(tmp_path_factory, FAST)


def _replayed(cap, label: str):
    """The replay's scheme of ``label`` and its plain whole-step reference (which the
    streamed replay equals bit for bit, tests/test_replay_stream.py), whose ``sent`` rows
    the hook's must be."""
    spec = parse_compressors(label)[0]
    ratio = None if spec.fixed_rate else RATIO
    k = None if ratio is None else k_for(ratio, cap.numel)
    shapes = scope_shapes(cap.layers, cap.scopes("model")[0])
    scheme = build_scheme(spec, ratio, k, numel=cap.numel, shapes=shapes, seed=0)
    return scheme, Reference(spec.name, spec.params, ratio, k, cap.numel, shapes, 0, 2)


def check_against_replay(out, label: str) -> None:
    name = label.split(":")[0]
    with open_capture(out / label.replace(":", "_")) as cap:
        assert cap.has_sent and cap.compressor["name"] == label
        scheme, reference = _replayed(cap, label)
        applied = [np.load(out / label.replace(":", "_") / f"applied-rank{r}.npy") for r in (0, 1)]
        for i, step in enumerate(cap.steps):
            grads = cap.read_step(step)
            sent = cap.read_step(step, dataset="sent")
            exchange = scheme.step(grads)
            replayed = reference.step(grads)
            if name == "powersgd":  # sums over learners in another order: float rounding
                torch.testing.assert_close(sent, replayed.sent, rtol=1e-4, atol=1e-6)
            else:  # each learner draws its own random stream, as in the replay
                torch.testing.assert_close(sent, replayed.sent, rtol=0, atol=0)
            # the update applied is the compressor's aggregate of what the learners sent
            compressor = scheme.compressor
            aggregate = compressor.aggregate(list(sent))
            aggregate = aggregate / 2 if compressor.average else aggregate
            for rank in (0, 1):
                np.testing.assert_allclose(
                    applied[rank][i],
                    aggregate.numpy(),
                    rtol=ROUNDING.get(name, 1e-5),
                    atol=1e-6 * float(aggregate.abs().max()),
                )
            # predicted bytes = bytes the hooks put into their collectives
            assert cap.sent_bytes[:, i].mean() == pytest.approx(exchange.bytes_per_learner)


@pytest.mark.parametrize("label", FAST)
def test_hook_sends_what_the_replay_sends(fast_runs, label):
    check_against_replay(fast_runs, label)


@pytest.mark.slow
def test_every_other_hook_sends_what_the_replay_sends(tmp_path_factory):
    out = _train(tmp_path_factory, SLOW)
    for label in SLOW:
        check_against_replay(out, label)


def test_topk_error_feedback_matches_an_independent_implementation(fast_runs):
    """sent_t = topk(g_t + m_t), m_{t+1} = g_t + m_t - sent_t, in numpy."""
    with open_capture(fast_runs / "topk") as cap:
        k = k_for(RATIO, cap.numel)
        memory = np.zeros((2, cap.numel), dtype=np.float32)
        for step in cap.steps:
            grads = cap.read_step(step).numpy()
            recorded = cap.read_step(step, dataset="sent").numpy()
            corrected = grads + memory
            expected = np.zeros_like(corrected)
            for learner in range(2):
                top = np.argsort(-np.abs(corrected[learner]), kind="stable")[:k]
                expected[learner, top] = corrected[learner, top]
            np.testing.assert_array_equal(recorded, expected)
            assert (np.count_nonzero(recorded, axis=1) == k).all()
            memory = corrected - expected
            # k (int32 index, float32 value) pairs: the bytes the hook all-gathered
            assert (cap.sent_bytes[:, list(cap.steps).index(step)] == 8 * k).all()


def test_info_json_shows_the_compressor_and_the_sent_dataset(fast_runs, capsys):
    from tests.helpers import run_cli

    result = run_cli(capsys, "info", fast_runs / "clt-k_beta=0.5", "--json")
    assert result.code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["datasets"] == ["grad", "sent"]
    assert doc["compressor"]["name"] == "clt-k:beta=0.5"
    assert doc["compressor"]["ratio"] == RATIO
    assert doc["compressor"]["settings"]["beta"] == 0.5


def test_hook_arguments_are_checked():
    with pytest.raises(UsageError, match="give it a ratio"):
        compression_hook("topk")
    with pytest.raises(UsageError, match="no parameter 'rank'"):
        compression_hook("topk", ratio=0.1, rank=2)
    with pytest.raises(UsageError, match="unknown compressor"):
        compression_hook("zip", ratio=0.1)
    with pytest.raises(UsageError, match="outside"):
        compression_hook("topk", ratio=1.5)
    _, state = compression_hook("powersgd", rank=2)
    assert state.ratio is None and state.label == "powersgd:rank=2"
    assert sys.modules["gradstat.hooks.compression"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--compressor", "topk"], "give --ratio"),
        (["--compressor", "fp16", "--ratio", "0.1"], "fixed rate"),
        (["--compressor", "topk", "--ratio", "0.1", "--layers", "fc"], "drop --layers"),
        (["--compressor", "topk", "--ratio", "0.1", "--comm-hook", "fp16"], "--comm-hook"),
        (["--compressor", "zip", "--ratio", "0.1"], "unknown compressor"),
        (["--ratio", "0.1"], "--compressor only"),
    ],
)
def test_capture_compressor_options_are_checked(capsys, tmp_path, args, message):
    from tests.helpers import assert_clean_error, run_cli

    result = run_cli(capsys, "capture", "--workload", "digits", "--out", tmp_path / "x", *args)
    assert_clean_error(result, 2)
    assert message in result.stderr
