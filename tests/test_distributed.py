"""Every analysis command prints the same under torchrun (2 gloo ranks) and with
``--jobs 2`` as in one process, and replay's scratch-file memories change nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from gradstat.analysis import ef_store
from gradstat.analysis.compute import Compute
from gradstat.analysis.replay import Replay, ReplayParams
from gradstat.analysis.selection import Selection
from gradstat.compressors import parse_link
from gradstat.errors import UsageError
from gradstat.store import layer_table, open_capture, write_capture
from tests.helpers import TESTS, run_cli, torchrun

#: Fields that are measured times (or derived from them), never equal between runs.
MEASURED = {
    "compress_seconds",
    "measured_compress_seconds",
    "compress_spread",
    "measured_compress_spread",
    "seconds",
    "speedup",
    "explanation",
}
COMMANDS = {
    "fit": ["--ratios", "0.01,0.1", "--dist", "gpd,exp"],
    "similarity": ["--ratio", "0.05"],
    "buildup": ["--ratios", "0.05,0.1"],
    "overlap": ["--ratio", "0.05", "--lag", "2"],
    "noise": ["--batch-size", "8", "--compressors", "topk", "--ratios", "0.05"],
    "consistency": ["--compressors", "topk", "--ratios", "0.05"],
    "replay": ["--compressors", "topk,clt-k,gtopk,dgc,powersgd,fp16", "--ratios", "0.05"],
    # only fp16 fits the budget: the ranking does not hang on measured times; a built-in
    # target, since cpu-here's rates are measured (at each process's thread count)
    "recommend": [
        *("--error-budget", "0.01", "--compressors", "topk,fp16", "--ratios", "0.1"),
        *("--target", "h100"),
    ],
}


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    """3 learners x 6 steps of a shared Laplace signal plus each learner's own."""
    rng = np.random.default_rng(1)
    layers = layer_table([("conv.weight", (8, 1, 3, 3)), ("fc.weight", (10, 50))])
    d = layers[-1].stop
    grads = rng.laplace(size=(1, 6, d)) + 0.5 * rng.laplace(size=(3, 6, d))
    return write_capture(tmp_path_factory.mktemp("dist") / "cap", grads.astype(np.float32), layers)


def _argv(command: str, path, *extra: str) -> list[str]:
    return [command, str(path), *COMMANDS[command], "--json", *extra]


def _unmeasured(document):
    """``document`` without the measured fields (MEASURED)."""
    if isinstance(document, dict):
        return {k: _unmeasured(v) for k, v in document.items() if k not in MEASURED}
    if isinstance(document, list):
        return [_unmeasured(v) for v in document]
    return document


def _single(capsys, argv: list[str]) -> tuple[dict, str]:
    result = run_cli(capsys, *argv)
    assert result.code == 0, result.stderr
    return _unmeasured(json.loads(result.stdout)), _messages(result.stderr)


def _messages(stderr: str) -> list[str]:
    """Warning and error lines (progress lines on a slow run come and go with timing)."""
    return [line for line in stderr.splitlines() if line.startswith(("Warning:", "Error:"))]


def test_every_command_prints_the_same_under_torchrun(capsys, capture, tmp_path):
    commands = [_argv(name, capture) for name in COMMANDS]
    out = tmp_path / "results.json"
    job = torchrun(TESTS / "distributed_commands.py", str(out), json.dumps(commands))
    assert job.returncode == 0, job.stderr[-3000:]
    for argv, got in zip(commands, json.loads(out.read_text()), strict=True):
        expected, expected_err = _single(capsys, argv)
        assert got["code"] == 0, got["stderr"]
        assert _unmeasured(json.loads(got["stdout"])) == expected, argv[0]
        assert _messages(got["stderr"]) == expected_err, argv[0]


def _gradstat_torchrun(argv: list[str]) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node 2 -m gradstat ARGV``, as users start it."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "gradstat",
            *argv,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=False,
    )


# slow: test_every_command_prints_the_same_under_torchrun runs replay under torchrun too
@pytest.mark.slow
@pytest.mark.parametrize("command", ["replay"])
def test_torchrun_m_gradstat_prints_one_document_on_rank_0(capsys, capture, command):
    """The real entry point: one JSON document on stdout (the other rank prints nothing)."""
    argv = [*_argv(command, capture), "--steps", "0,2,3"]
    job = _gradstat_torchrun(argv)
    assert job.returncode == 0, job.stderr[-3000:]
    expected, expected_err = _single(capsys, argv)
    assert _unmeasured(json.loads(job.stdout)) == expected
    assert len(expected_err) == 1 and "over steps 0..3" in expected_err[0]  # one gap warning
    assert job.stderr.count("Warning:") == 1 and "gap" in job.stderr


@pytest.mark.slow
@pytest.mark.parametrize("command", list(COMMANDS))
def test_torchrun_m_gradstat_every_command(capsys, capture, command):
    job = _gradstat_torchrun(_argv(command, capture))
    assert job.returncode == 0, job.stderr[-3000:]
    assert _unmeasured(json.loads(job.stdout)) == _single(capsys, _argv(command, capture))[0]


#: --jobs 2 in make test: one command per kind of unit (rows, step pairs, configurations,
#: overlap's lags in test_parallel.py); the others, whose units are those, in the slow set
JOBS_SLOW = {"overlap", "recommend", "noise", "consistency", "buildup", "fit", "replay"}


@pytest.mark.parametrize(
    "command",
    [pytest.param(c, marks=[pytest.mark.slow] if c in JOBS_SLOW else []) for c in COMMANDS],
)
def test_jobs_2_prints_what_jobs_1_prints(capsys, capture, command):
    one = _single(capsys, _argv(command, capture, "--jobs", "1"))
    two = _single(capsys, _argv(command, capture, "--jobs", "2"))
    assert two == one


def test_replay_errors_in_a_worker_are_one_error_line(capsys, tmp_path):
    grads = np.ones((2, 3, 100), dtype=np.float32)
    grads[1, 2, 5] = np.inf
    path = write_capture(tmp_path / "inf", grads, layer_table([("w", (100,))]))
    result = run_cli(
        capsys, "replay", path, "--compressors", "topk,fp16", "--ratios", "0.1", "--jobs", "2"
    )
    assert result.code == 1 and result.stderr.count("Error:") == 1
    assert "step 2, learner 1" in result.stderr and "Traceback" not in result.stderr


def test_replay_with_scratch_memories_equals_replay_in_memory(tmp_path, monkeypatch):
    """Memories over the budget go to a scratch file under ``$GRADSTAT_SCRATCH`` (where
    none can be made, only the replay over the budget fails), removed when the replay
    ends; the records stay bit for bit."""
    rng = np.random.default_rng(2)
    layers = layer_table([("w", (300, 300)), ("b", (300,))])
    d = layers[-1].stop
    grads = (rng.laplace(size=(1, 3, d)) + rng.laplace(size=(3, 3, d))).astype(np.float32)
    path = write_capture(tmp_path / "cap", grads, layers)
    params = ReplayParams("topk,dgc,clt-k,gtopk,powersgd", (0.01,), parse_link("10Gbit/s", "5us"))
    scratch = tmp_path / "scratch"
    with open_capture(path) as cap:
        selection = Selection.of(cap)

        def run(memory):  # 3 x 90,300 x 4 bytes per memory > 1 MiB
            replay = Replay(cap, selection, params, compute=Compute("cpu", 1, memory))
            return replay.run().drop(columns=["compress_seconds"])

        monkeypatch.setenv(ef_store.SCRATCH_ENV, str(scratch))  # not made yet
        in_memory = run(None)
        with pytest.raises(UsageError, match=r"scratch folder .*cannot create a file there"):
            run(1 << 20)
        scratch.mkdir()
        in_scratch = run(1 << 20)
    assert list(scratch.iterdir()) == []
    pd.testing.assert_frame_equal(in_memory, in_scratch)
