"""Capture faults with real gloo training: misuse of the hook, a full disk, Ctrl-C
(issue 12, items 2, 3, 4, 6, 7)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from gradstat import open_capture
from gradstat.store.schema import rank_file_name
from tests.helpers import TESTS, interruptible, run_cli, torchrun

SCRIPT = TESTS / "ddp_faults_train.py"


def _rows_match_reference(out):
    """Every recorded row's learner mean is the all-reduced .grad of its step."""
    references = [np.load(out / f"reference-rank{r}.npy") for r in range(2)]
    steps = list(np.load(out / "reference-steps.npy"))
    with open_capture(out) as cap:
        assert cap.status == "complete"
        assert list(cap.steps) == steps
        for row, (_, grads) in enumerate(cap.iter_steps()):
            np.testing.assert_allclose(
                grads.mean(0).numpy(), references[0][row], rtol=1e-5, atol=1e-7
            )


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    """Every fault of tests/ddp_faults_train.py, one after another in one launch."""
    out = tmp_path_factory.mktemp("faults")
    result = torchrun(SCRIPT, "--out", str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def _stderr(faults, fault: str) -> str:
    """What both learners printed to stderr during ``fault``'s run."""
    return "".join((faults / f"{fault}-stderr-rank{r}.txt").read_text() for r in range(2))


def test_accumulation_without_no_sync_records_and_warns_once(faults):
    """Regression: every row was dropped silently ('complete, 0 recorded')."""
    assert _stderr(faults, "accumulate").count("ddp.no_sync()") == 2  # once per learner
    _rows_match_reference(faults / "accumulate")


def test_skipped_step_call_does_not_lose_the_next_step(faults):
    """Regression: after a skipped capture.step() the next step's row was dropped."""
    assert "once per step" in _stderr(faults, "skip")
    _rows_match_reference(faults / "skip")  # steps 0, 2, 3


def test_model_with_a_comm_hook_is_refused_before_any_file(faults):
    stderr = _stderr(faults, "hooked")
    assert stderr.count("Error: ") == 2  # on each learner
    assert "already has a communication hook (fp16_compress_hook)" in stderr
    assert "hook=your_hook, hook_state=" in stderr
    assert not (faults / "hooked").exists()


def _capture_argv(out, *extra):
    return [
        sys.executable,
        "-m",
        "gradstat",
        "capture",
        "--workload",
        "digits",
        "--size",
        "tiny",
        "--nproc-per-node",
        "2",
        "--out",
        str(out),
        *extra,
    ]


def test_full_disk_is_reported_with_what_was_recorded(tmp_path, capsys):
    """Regression: 'captured 60 steps' and exit 0 after the writer stopped at step 3,
    with a 16 MiB margin whatever the row size; info said 'interrupted'."""
    import resource

    out = tmp_path / "full"
    limit = 2_000_000  # bytes per file: about 20 rows of this model

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    result = subprocess.run(
        _capture_argv(out, "--steps", "60"),
        capture_output=True,
        text=True,
        preexec_fn=limit_file_size,
        timeout=300,
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert "captured" not in result.stdout
    with open_capture(out) as cap:
        assert cap.status == "incomplete"
        recorded = len(cap.steps)
        row_bytes = cap.numel * 4
        stopped_at = int(cap.stop_reason.split("step ")[1].split()[0])
        for _, grads in cap.iter_steps():
            assert np.isfinite(grads.numpy()).all()
    # the margin is sized from the row: the writer used the space up to about 1 MiB
    assert limit - (recorded + 1) * row_bytes < (1 << 20) + 2 * row_bytes + 100_000
    assert f"disk full at step {stopped_at}" in result.stderr
    assert f"{recorded} steps x 2 learners recorded" in result.stderr
    info = run_cli(capsys, "info", out)
    assert info.code == 0
    assert f"incomplete (disk full at step {stopped_at}" in info.stdout.replace("\n", " ")
    with h5py.File(out / "capture.h5", "r") as root:
        assert root.attrs["status"] == "incomplete"  # capture.h5 and info agree


@pytest.mark.slow
def test_ctrl_c_during_capture_is_one_line_with_what_was_committed(tmp_path):
    """Regression: a group Ctrl-C printed 'capture failed: a learner failed'."""
    out = tmp_path / "interrupted"
    process = subprocess.Popen(
        _capture_argv(out, "--steps", "20000", "--layers", "bias$"),  # 16 MB budget
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=interruptible,
    )
    try:
        deadline = time.time() + 120
        committed = 0
        while time.time() < deadline and committed < 2:
            time.sleep(0.5)
            try:
                with h5py.File(out / rank_file_name(1), "r", swmr=True) as f:
                    committed = int(f.attrs["committed"])
            except (OSError, KeyError):
                pass
        assert committed >= 2, "the capture did not start"
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C reaches the whole process group
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 130, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len([line for line in lines if line.startswith("Error:")]) == 1, stderr
    assert "Error: interrupted;" in stderr and f"committed in {out}" in stderr
    assert "a learner failed" not in stderr and "Traceback" not in stderr
    with open_capture(out) as cap:
        assert len(cap.steps) >= 2
    doc = json.loads(
        subprocess.run(
            [sys.executable, "-m", "gradstat", "info", str(out), "--json"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    assert doc["status"] == "interrupted"
