"""Trained states: ``capture --warmup-steps``, ``--save`` and ``--resume`` (real gloo
training of the tiny digits CNN), and the batch size a capture records."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradstat.capture import checkpoint
from gradstat.capture.hook_setup import check_settings
from gradstat.errors import UsageError
from gradstat.store import open_capture
from tests.helpers import assert_clean_error, run_cli

BASE = {"workload": "digits", "size": "tiny", "nproc_per_node": 2, "command": "tests"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """6 steps straight; 2 warm-up steps then 2 recorded ones, saved; then resumed for 2."""
    from gradstat.capture.launch import CaptureOptions, run_capture

    root = tmp_path_factory.mktemp("trained")
    state = root / "state.pt"
    straight = run_capture(CaptureOptions(steps=6, out=root / "straight", **BASE))
    saved = run_capture(
        CaptureOptions(warmup_steps=2, steps=2, save=state, out=root / "saved", **BASE)
    )
    resumed = run_capture(CaptureOptions(steps=2, resume=state, out=root / "resumed", **BASE))
    return straight, saved, resumed, state


def test_warm_up_and_resume_record_the_gradients_of_an_unbroken_run(runs):
    straight, saved, resumed, state = runs
    with open_capture(straight) as whole, open_capture(saved) as a, open_capture(resumed) as b:
        assert list(a.steps) == [2, 3] and list(b.steps) == [4, 5]
        assert whole.batch_size == a.batch_size == b.batch_size == 32
        assert a.meta["warmup_steps"] == 2 and b.meta["resumed_at"] == 4
        for part in (a, b):
            for i, step in enumerate(part.steps):
                row = list(whole.steps).index(step)
                for learner in (0, 1):  # bit for bit: model, optimizer, data and RNG
                    assert np.array_equal(
                        part.read_row(step, learner), whole.read_row(step, learner)
                    )
                assert np.array_equal(part.losses[:, i], whole.losses[:, row])
    found = checkpoint.read(state)
    assert found["step"] == 4 and found["world_size"] == 2 and found["batch_size"] == 32
    assert len(found["rng"]) == 2


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--nproc-per-node", "3"], "saved with world_size 2, this run has 3"),
        (["--seed", "5"], "saved with seed 0, this run has 5"),
        (["--batch-size", "8"], "saved with batch_size 32, this run has 8"),
        (["--workload", "charlm"], "saved with workload 'digits', this run has 'charlm'"),
    ],
)
def test_resume_refuses_a_checkpoint_of_another_run(tmp_path, capsys, options, message):
    state = tmp_path / "state.pt"
    identity = checkpoint.run_identity("digits", "tiny", None, 0, 32, 2)
    torch.save({"format": checkpoint.FORMAT, "version": 1, **identity, "step": 3}, state)
    argv = ["capture", "--workload", "digits", "--size", "tiny", "--nproc-per-node", "2"]
    result = run_cli(capsys, *argv, "--resume", state, *options, "--out", tmp_path / "c")
    assert_clean_error(result, 2)
    assert message in " ".join(result.stderr.split())
    assert not (tmp_path / "c").exists()  # refused before anything started


def test_checkpoint_options_are_checked_before_training(tmp_path, capsys):
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(3)}, other)
    cases = [
        (["--resume", other], 1, "not a gradstat checkpoint"),
        (["--resume", tmp_path / "none.pt"], 2, "no such file"),
        (["--save", tmp_path], 2, "is a folder; give a file name"),
        (["--save", tmp_path / "no" / "s.pt"], 2, "no such folder"),
        (["--save", tmp_path / "s.pt", "--fsdp"], 2, "keep DDP runs' state; drop --fsdp"),
        (["--warmup-steps", "-1"], 2, "--warmup-steps must be at least 0"),
    ]
    for options, code, message in cases:
        result = run_cli(capsys, "capture", "-w", "digits", *options, "--out", tmp_path / "c")
        assert_clean_error(result, code)
        assert message in " ".join(result.stderr.split()), options


def test_the_hook_refuses_a_batch_size_that_is_no_count():
    for bad in (0, -4, 2.5, True):
        with pytest.raises(UsageError, match="batch_size must be a positive integer"):
            check_settings(1, 0, "float32", "none", bad)
    check_settings(1, 0, "float32", "none", 16)
