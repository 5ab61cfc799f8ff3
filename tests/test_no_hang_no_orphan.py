"""No hang, no orphan, the right culprit (issue 40.5).

A layer-name pattern that backtracks is refused within seconds; ``--jobs`` workers, the
multiprocessing resource tracker and the child that reads metadata end with the command
however it ends (SIGTERM, SIGKILL); a capture that failed names the learner and signal
torchrun names as the root cause.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np
import pytest

from gradstat.store import layer_table, write_capture
from gradstat.store.schema import rank_file_name
from tests.fuzz_scenarios import alive, descendants
from tests.helpers import assert_clean_error, interruptible, run_cli

ROOT = Path(__file__).parent.parent


def _gradstat(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "gradstat", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        preexec_fn=interruptible,
    )


def test_a_pattern_that_backtracks_is_refused_in_seconds(tmp_path, capsys):
    """Regression: --scope '(.*.*)*X$' ran 44 s on 16-character layer names (and
    longer on longer ones) before anything was computed."""
    layers = layer_table([("encoder.layers.0.attention.weight", (4, 4)), ("head.bias", (4,))])
    grads = np.random.default_rng(0).normal(size=(2, 2, 20)).astype(np.float32)
    path = write_capture(tmp_path / "cap", grads, layers)
    started = time.monotonic()
    result = run_cli(capsys, "fit", path, "--scope", "(.*.*)*X$", "--ratios", "0.1")
    assert time.monotonic() - started < 30
    assert_clean_error(result, 2)
    assert len(result.stderr.strip().splitlines()) == 1
    assert "did not finish matching 2 layer names within 2 s" in result.stderr
    assert run_cli(capsys, "fit", path, "--scope", "bias$", "--ratios", "0.5").code == 0


@pytest.fixture(scope="module")
def slow_fit(tmp_path_factory) -> Path:
    """A capture whose MLE fits take a while per step (--jobs 2 then has two workers)."""
    grads = np.random.default_rng(1).laplace(size=(2, 8, 400_000)).astype(np.float32)
    path = tmp_path_factory.mktemp("jobs") / "cap"
    return write_capture(path, grads, layer_table([("w", (400_000,))]))


@pytest.mark.parametrize(
    "signum", [signal.SIGKILL, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)]
)
def test_jobs_workers_end_with_their_parent(slow_fit, signum):
    """Regression: `fit --dist all --method mle --jobs 2` stopped with SIGTERM left both
    workers and the resource tracker running (still there 115 s later)."""
    fit = ["fit", str(slow_fit), "--dist", "all", "--method", "mle", "--jobs", "2"]
    process = _gradstat(*fit, "--ratios", "0.01")
    try:
        deadline, below = time.time() + 300, set()
        while time.time() < deadline and process.poll() is None:
            below = descendants(process.pid)
            workers = [p for p in below if b"gradstat-jobs" in _cmdline(p) or _is_spawn(p)]
            if len(workers) >= 2:
                break
            time.sleep(0.2)
        assert process.poll() is None, process.communicate()
        time.sleep(1.0)  # the workers are inside their units
        below = descendants(process.pid)
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    deadline = time.time() + 20
    while time.time() < deadline and alive(below):
        time.sleep(0.2)
    assert not alive(below), [_cmdline(p) for p in alive(below)]
    if signum == signal.SIGTERM:
        assert process.returncode == 143, stderr
        assert stderr.strip().splitlines()[-1] == "Error: terminated (SIGTERM)", stderr


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _is_spawn(pid: int) -> bool:
    return b"multiprocessing.spawn" in _cmdline(pid)


def test_the_metadata_reader_ends_with_a_killed_parent(tmp_path):
    """The forked child that reads metadata (HDF5 may loop in it for minutes) ends
    when the command is killed by SIGKILL, which cannot kill the child itself."""
    from tests.test_cli_faults import _flip_byte, _killed_capture

    path = _killed_capture(tmp_path / "killed")
    _flip_byte(path / rank_file_name(0), 209)  # HDF5 retries this metadata in SWMR mode
    process = _gradstat("info", str(path), env={"GRADSTAT_OPEN_TIMEOUT": "300"})
    try:
        deadline, below = time.time() + 120, set()
        while time.time() < deadline and process.poll() is None and not below:
            below = descendants(process.pid)
            time.sleep(0.2)
        assert below and process.poll() is None, process.communicate()
        time.sleep(1.0)
        process.kill()
        process.wait()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    deadline = time.time() + 10
    while time.time() < deadline and alive(below):
        time.sleep(0.1)
    assert not alive(below)


TORCHRUN_SUMMARY = [
    "[rank0]: RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer",
    "============================================================",
    "gradstat.capture.worker FAILED",
    "------------------------------------------------------------",
    "Failures:",
    "[1]:",
    "  time      : 2026-01-01_00:00:01",
    "  rank      : 0 (local_rank: 0)",
    "  exitcode  : -15 (pid: 4241)",
    "  traceback : Signal 15 (SIGTERM) received by PID 4241",
    "------------------------------------------------------------",
    "Root Cause (first observed failure):",
    "[0]:",
    "  time      : 2026-01-01_00:00:00",
    "  rank      : 1 (local_rank: 1)",
    "  exitcode  : -9 (pid: 4242)",
    "  traceback : Signal 9 (SIGKILL) received by PID 4242",
    "============================================================",
]


def test_the_root_cause_is_the_learner_torchrun_names():
    """Regression: a learner killed by SIGKILL was reported as "learner 0 died (signal
    15, SIGTERM)": torchrun lists the others' failures before its root cause."""
    from gradstat.capture.launch import failure_reason

    assert failure_reason(deque(TORCHRUN_SUMMARY)) == "learner 1 died (signal 9, SIGKILL)"
    # a root cause that exited with an error: its error, not the others' SIGTERM
    exited = [line.replace("-9 (pid", "1 (pid") for line in TORCHRUN_SUMMARY]
    exited.insert(0, "[rank1]: ValueError: bad batch")
    assert failure_reason(deque(exited)) == "ValueError: bad batch"


@pytest.mark.slow  # a real capture (the test above covers the summary's reading)
def test_a_learner_killed_by_sigkill_is_named_as_the_cause(tmp_path):
    out = tmp_path / "run"
    argv = ["capture", "--workload", "digits", "--steps", "100000", "--nproc-per-node", "2"]
    process = _gradstat(*argv, "--layers", "bias$", "--out", str(out))
    try:
        deadline, learner = time.time() + 180, None
        while time.time() < deadline and learner is None and process.poll() is None:
            for pid in descendants(process.pid):
                try:
                    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                if b"LOCAL_RANK=1" in environ and b"gradstat.capture.worker" in _cmdline(pid):
                    learner = pid
            time.sleep(0.5)
        assert learner is not None, process.communicate()
        while not (out / rank_file_name(1)).exists():
            time.sleep(0.2)
        time.sleep(2)
        os.kill(learner, signal.SIGKILL)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 1, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "learner 1 died (signal 9, SIGKILL)" in errors[0], stderr
