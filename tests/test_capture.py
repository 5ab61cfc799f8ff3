"""Real multi-process capture: correctness of the hook, the format, faults and bad input."""

from __future__ import annotations

import itertools
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
from tests.helpers import TESTS, assert_clean_error, run_cli, torchrun

SCRIPT = TESTS / "ddp_reference_train.py"


#: the runs of tests/ddp_reference_train.py this module checks, trained in one launch
RUNS = {
    "digits": ["--workload", "digits", "--steps", "3"],
    "charlm": ["--workload", "charlm", "--steps", "3"],
    "fp16": ["--hook", "fp16", "--steps", "3"],
    "powersgd": ["--hook", "powersgd", "--steps", "4"],
    "powersgd-without": ["--hook", "powersgd", "--steps", "4", "--no-capture"],
    "accumulate": ["--accumulate", "3", "--steps", "2"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each run of RUNS in its folder: one torchrun launch trains them one after another."""
    out = tmp_path_factory.mktemp("reference")
    argv = [["--out", str(out / name), *args] for name, args in RUNS.items()]
    result = torchrun(SCRIPT, "--runs", json.dumps(argv), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return out


def _check_mean_equals_allreduced(out, rtol, atol):
    references = [np.load(out / f"reference-rank{r}.npy") for r in range(2)]
    np.testing.assert_array_equal(references[0], references[1])  # DDP keeps ranks in sync
    with open_capture(out) as cap:
        assert cap.status == "complete"
        assert list(cap.steps) == list(range(len(references[0])))
        for row, (_step, grads) in enumerate(cap.iter_steps()):
            mean = grads.mean(0).numpy()
            np.testing.assert_allclose(mean, references[0][row], rtol=rtol, atol=atol)
            assert not np.allclose(grads[0].numpy(), grads[1].numpy()), "learners must differ"
        return cap.describe()


@pytest.mark.parametrize("workload", ["digits", "charlm"])
def test_mean_of_recorded_gradients_is_the_allreduced_gradient(runs, workload):
    summary = _check_mean_equals_allreduced(runs / workload, rtol=1e-5, atol=1e-7)
    layers = summary["layers"]
    assert layers[0]["offset"] == 0
    for before, after in itertools.pairwise(layers):
        assert before["offset"] + before["numel"] == after["offset"]
    assert layers[-1]["offset"] + layers[-1]["numel"] == summary["numel"]
    for layer in layers:
        assert int(np.prod(layer["shape"])) == layer["numel"]


def test_the_capture_records_the_batch_size_the_script_gave(runs):
    for name, batch in (("digits", 16), ("accumulate", 48)):
        with open_capture(runs / name) as cap:
            assert cap.batch_size == batch and cap.describe()["batch_size"] == batch


def test_fp16_hook_inside_capture_sees_the_uncompressed_local_gradient(runs):
    # .grad is the fp16 all-reduce: equal to our fp32 mean to fp16 precision only
    _check_mean_equals_allreduced(runs / "fp16", rtol=2e-3, atol=1e-4)


def test_powersgd_hook_trains_exactly_as_without_capture(runs):
    with_capture, without = runs / "powersgd", runs / "powersgd-without"
    np.testing.assert_array_equal(
        np.load(with_capture / "weights-rank0.npy"), np.load(without / "weights-rank0.npy")
    )
    with open_capture(with_capture) as cap:
        assert len(cap.steps) == 4
    assert not (without / "capture.h5").exists()


def test_no_sync_accumulation_records_the_accumulated_gradient(runs):
    _check_mean_equals_allreduced(runs / "accumulate", rtol=1e-5, atol=1e-7)


def test_capture_cli_every_start_layers_float16(tmp_path, capsys):
    out = tmp_path / "run"
    result = run_cli(
        capsys,
        "capture",
        "--workload",
        "digits",
        "--nproc-per-node",
        "2",
        "--steps",
        "7",
        "--every",
        "3",
        "--start",
        "1",
        "--layers",
        "^0\\.|^8\\.",
        "--dtype",
        "float16",
        "--max-bytes",
        "10MB",
        "--out",
        out,
    )
    assert result.code == 0, result
    # the disk budget: the expected size is printed before training, and it fits
    assert "capture: expected" in result.stderr and "2 rows x 2 learners" in result.stderr
    with open_capture(out) as cap:
        assert list(cap.steps) == [1, 4]
        assert cap.dtype == "float16"
        assert [layer.name for layer in cap.layers] == ["0.weight", "0.bias", "8.weight", "8.bias"]
        assert cap.read_step(4).dtype.is_floating_point
        assert cap.meta["workload"] == "digits"
    with h5py.File(out / rank_file_name(0), "r") as f:  # closed cleanly: plain read mode works
        assert f["grad"].dtype == np.float16
        assert f["grad"].chunks[0] == 1
    with h5py.File(out / "capture.h5", "r") as f:  # virtual datasets for other tools
        assert f["grad"].shape == (2, 2, cap.numel)
        np.testing.assert_array_equal(f["step"][1], [1, 4])
    info = run_cli(capsys, "info", out, "--json")
    import json

    doc = json.loads(info.stdout)
    for key in (
        "learners",
        "world_size",
        "steps",
        "numel",
        "layers",
        "dtype",
        "workload",
        "status",
    ):
        assert key in doc
    assert doc["steps"] == [1, 4] and doc["status"] == "complete" and doc["learners"] == 2


def test_sigkill_leaves_a_readable_capture(tmp_path, capsys):
    out = tmp_path / "killed"
    argv = [
        sys.executable,
        "-m",
        "gradstat",
        "capture",
        "--workload",
        "charlm",
        "--size",
        "tiny",
        "--nproc-per-node",
        "2",
        "--steps",
        "20000",  # runs until killed; only the biases are recorded, so the
        "--layers",  # disk budget (160 MB) fits any test machine
        "bias$",
        "--out",
        str(out),
    ]
    stderr_path = tmp_path / "capture.err"
    with open(stderr_path, "w") as stderr:
        process = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True
        )
    try:
        deadline = time.time() + 90
        committed = 0
        while time.time() < deadline and committed < 3:
            time.sleep(0.5)
            if (out / rank_file_name(1)).exists():
                try:
                    with h5py.File(out / rank_file_name(1), "r", swmr=True) as f:
                        committed = int(f.attrs["committed"])
                except OSError:
                    pass
        assert committed >= 3, f"the capture did not start: {stderr_path.read_text()}"
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the launcher and torchrun
        process.wait()
    deadline = time.time() + 30  # learners die with torchrun (parent-death signal)
    while time.time() < deadline and run_cli(capsys, "info", out, "--json").stdout.count(
        '"status": "running"'
    ):
        time.sleep(0.2)
    result = run_cli(capsys, "info", out, "--json")
    assert result.code == 0, result
    import json

    doc = json.loads(result.stdout)
    assert doc["status"] == "interrupted"
    assert len(doc["steps"]) >= committed
    assert doc["steps"] == list(range(len(doc["steps"])))
    with open_capture(out) as cap:  # every committed step reads back in full
        for _, grads in cap.iter_steps():
            assert grads.shape == (2, cap.numel)
            assert np.isfinite(grads.numpy()).all()
    text = run_cli(capsys, "info", out)
    assert "interrupted (committed up to step" in text.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--every", "0"], "--every must be at least 1"),
        (["--workload", "resnet9000"], "unknown workload"),
        (["--nproc-per-node", "0"], "--nproc-per-node must be at least 1"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--dtype", "int8"], "--dtype must be one of"),
        (["--backend", "mpi"], "--backend must be one of"),
        (["--layers", "(("], "not a valid regex"),
        (["--start", "50", "--steps", "10"], "nothing would be recorded"),
        (["--data", "/nonexistent.txt"], "no such file"),
        (["--backend", "nccl"], "needs CUDA"),
    ],
)
def test_capture_bad_options(tmp_path, capsys, args, message):
    result = run_cli(capsys, "capture", "--out", tmp_path / "x", *args)
    assert_clean_error(result, code=2)
    assert message in result.stderr
    assert not (tmp_path / "x").exists()


def test_capture_refuses_to_overwrite(tmp_path, capsys, synthetic_capture):
    path, _ = synthetic_capture
    result = run_cli(capsys, "capture", "--out", path, "--steps", "2")
    assert_clean_error(result, code=2)
    assert "already exists" in result.stderr
    with open_capture(path) as cap:
        assert len(cap.steps) == 6


def test_progress_lines_that_interleaved_are_logged_not_fatal():
    """Regression: two learners' output once merged into one progress line."""
    from gradstat.capture.follow import progress_report as _progress_report
    from gradstat.capture.worker import PROGRESS_PREFIX

    good = PROGRESS_PREFIX + '{"step": 3, "loss": 1.5, "bytes": 10, "rows": 3, "elapsed": 1.0}\n'
    assert _progress_report(good)["step"] == 3
    merged = good.rstrip("\n") + "Warning: gradstat stopped recording\n"
    assert _progress_report(merged) is None
    assert _progress_report("W1129 some torchrun log line\n") is None


def test_capture_options_are_named_as_the_fields_of_capture_options():
    """capture_command hands its parameters to CaptureOptions by name."""
    import dataclasses
    import inspect

    from gradstat.capture.launch import CaptureOptions
    from gradstat.cli.capture import capture_command

    names = set(inspect.signature(capture_command).parameters) - {"list_workloads"}
    assert names <= {f.name for f in dataclasses.fields(CaptureOptions)}
