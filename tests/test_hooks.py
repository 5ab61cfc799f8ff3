"""Compression hooks in real DDP training (2 gloo learners) against the replay.

One torchrun run trains the digits CNN with each compressor's hook for 3 steps at a
granularity (DDP's buckets at bucket_cap_mb 0.01: several; each parameter; the whole
model) and records ``grad`` and ``sent`` (tests/hooks_train.py). Replaying the recorded
gradients with the same compressor, memory and plan must give the recorded ``sent``
rows (exactly: both run the same exchange on the same messages, with the same draws),
the update the optimizer applied must be the aggregate of ``sent``, and the bytes the
hook put into its collectives must be the replay's. At ``model`` granularity the rows
are also those of the plain whole-step reference (tests/reference_compressors.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gradstat.analysis.replay import capture_plan, trained_options
from gradstat.analysis.replay_block import replay_rows
from gradstat.compressors.registry import REGISTRY, build_scheme
from gradstat.compressors.spec import parse_compressors
from gradstat.errors import UsageError
from gradstat.hooks import compression_hook
from gradstat.store import open_capture
from tests.helpers import TESTS, torchrun
from tests.reference_compressors import Reference

RATIO = 0.05
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "compressors.py"
FAST = [
    "topk@bucket",
    "clt-k:beta=0.5@tensor",
    "randomk@bucket",
    "gtopk@bucket",
    "sidco-gpd@model",
    "threshold@tensor",
    "fp16@bucket",
    "powersgd:rank=2@tensor",
    "signsgd@bucket",
    "qsgd@tensor",
    "dgc@bucket",
    "terngrad+residual@model",
    f"{EXAMPLE}:TopK+residual@bucket",
    f"{EXAMPLE}:Quantize:bits=4@tensor",
    # regression: an aggregate adding into its first argument made rank 0's sent at
    # step 0 grad0 + grad1 (the hook handed it the learner's own vector)
    f"{TESTS / 'user_classes.py'}:InPlaceTopK+residual@model",
]
BUILTINS = [
    "none",
    "fp16",
    "bf16",
    "topk",
    "randomk",
    "threshold",
    "dgc",
    "gaussiank",
    "redsync",
    "sidco-exp",
    "sidco-gpd",
    "sidco-gamma-gpd",
    "clt-k",
    "gtopk",
    "powersgd",
    "signsgd",
    "ef-signsgd",
    "qsgd",
    "terngrad",
    f"{EXAMPLE}:TopK+residual",
    f"{EXAMPLE}:Quantize",
]
SLOW = [f"{name}@{g}" for g in ("model", "tensor", "bucket") for name in BUILTINS]
SLOW = [run for run in SLOW if run not in FAST]
#: relative rounding of the applied update: casts all-reduce the sum in 16 bits
ROUNDING = {"fp16": 2**-10, "bf16": 2**-7}


def folder(run: str) -> str:
    return "".join("_" if c in ":+/@" else c for c in run)


def _train(tmp_path_factory, runs: list[str]):
    out = tmp_path_factory.mktemp("hooks")
    result = torchrun(
        TESTS / "hooks_train.py",
        "--out",
        str(out),
        "--runs",
        ",".join(runs),
        "--ratio",
        str(RATIO),
        timeout=1800,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def fast_runs(tmp_path_factory):
    return _train(tmp_path_factory, FAST)


def _replayed(cap, spec_text: str):
    """The replay's scheme of the run on the plan it recorded."""
    spec = parse_compressors(spec_text)[0]
    ratio = None if spec.fixed_rate else RATIO
    plan = capture_plan(cap, cap.scopes("model")[0], **trained_options(cap))
    return build_scheme(spec, ratio, plan, seed=0)


def check_against_replay(out, run: str) -> None:
    spec_text, _, granularity = run.partition("@")
    name = parse_compressors(spec_text)[0].name
    with open_capture(out / folder(run)) as cap:
        assert cap.has_sent and cap.compressor["name"] == parse_compressors(spec_text)[0].label
        scheme = _replayed(cap, spec_text)
        assert scheme.plan.granularity.startswith(granularity)
        if granularity == "bucket":
            assert len(scheme.plan.messages) > 1
        reference = None
        if granularity == "model" and scheme.spec.name in REGISTRY and scheme.spec.memory is None:
            reference = Reference(
                name, scheme.spec.params, scheme.ratio, scheme.k(0), cap.numel,
                list(scheme.plan.messages[0].shapes), 0, 2,
            )  # fmt: skip
        applied = [np.load(out / folder(run) / f"applied-rank{r}.npy") for r in (0, 1)]
        for i, step in enumerate(cap.steps):
            grads = cap.read_step(step)
            sent = cap.read_step(step, dataset="sent")
            replayed = replay_rows(scheme, grads, int(step))
            if name == "powersgd":  # QR and matrix products of another process: rounding
                torch.testing.assert_close(sent, replayed.sent, rtol=1e-4, atol=1e-6)
            else:
                torch.testing.assert_close(sent, replayed.sent, rtol=0, atol=0)
            if reference is not None:
                torch.testing.assert_close(sent, reference.step(grads).sent, rtol=1e-4, atol=1e-6)
            # the update applied is each message's aggregate of what the learners sent
            for rank in (0, 1):
                np.testing.assert_allclose(
                    applied[rank][i],
                    replayed.estimate.numpy(),
                    rtol=ROUNDING.get(name, 1e-5),
                    atol=1e-6 * float(replayed.estimate.abs().max()),
                )
            # predicted bytes = bytes the hooks put into their collectives
            assert cap.sent_bytes[:, i].mean() == pytest.approx(replayed.bytes_per_learner)


@pytest.mark.parametrize("run", FAST)
def test_hook_sends_what_the_replay_sends(fast_runs, run):
    check_against_replay(fast_runs, run)


@pytest.mark.slow
def test_every_hook_at_every_granularity_sends_what_the_replay_sends(tmp_path_factory):
    out = _train(tmp_path_factory, SLOW)
    for run in SLOW:
        check_against_replay(out, run)


def test_topk_error_feedback_per_bucket_matches_an_independent_implementation(fast_runs):
    """Per DDP bucket: sent_t = topk(g_t + m_t) of each bucket's columns (its own k),
    m_{t+1} = g_t + m_t - sent_t, in numpy."""
    with open_capture(fast_runs / folder("topk@bucket")) as cap:
        plan = _replayed(cap, "topk").plan
        columns = [
            np.concatenate([np.arange(o, o + k) for o, k in m.slices]) for m in plan.messages
        ]
        ks = [max(1, round(RATIO * len(c))) for c in columns]
        memory = np.zeros((2, cap.numel), dtype=np.float32)
        for i, step in enumerate(cap.steps):
            grads = cap.read_step(step).numpy()
            recorded = cap.read_step(step, dataset="sent").numpy()
            corrected = grads + memory
            expected = np.zeros_like(corrected)
            for learner in range(2):
                for at, k in zip(columns, ks, strict=True):
                    top = at[np.argsort(-np.abs(corrected[learner, at]), kind="stable")[:k]]
                    expected[learner, top] = corrected[learner, top]
            np.testing.assert_array_equal(recorded, expected)
            assert (np.count_nonzero(recorded, axis=1) == sum(ks)).all()
            memory = corrected - expected
            # k (int32 index, float32 value) pairs per bucket: the bytes all-gathered
            assert (cap.sent_bytes[:, i] == 8 * sum(ks)).all()


def test_info_json_shows_the_compressor_and_the_sent_dataset(fast_runs, capsys):
    from tests.helpers import run_cli

    result = run_cli(capsys, "info", fast_runs / folder("clt-k:beta=0.5@tensor"), "--json")
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
