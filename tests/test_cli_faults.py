"""Every fault one clear line: hostile text, bad paths, Ctrl-C (issue 12, items 5, 6, 8)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from gradstat.store import layer_table, write_capture
from gradstat.store.schema import rank_file_name
from tests.helpers import assert_clean_error, interruptible, run_cli


def test_markup_in_arguments_is_one_error_line(capsys, tmp_path):
    """Regression: 'nosuch[/x]' ended in a rich MarkupError traceback."""
    result = run_cli(capsys, "info", "nosuch[/x]")
    assert_clean_error(result, code=2)  # a missing path is bad usage (issue 30.12)
    assert "nosuch[/x]: no such file" in result.stderr
    assert len([line for line in result.stderr.splitlines() if line.strip()]) == 1


def test_markup_in_user_text_prints_literally(capsys, tmp_path):
    """Regression: a layer named 'foo[bold]bar' printed as 'foobar'."""
    layers = layer_table([("foo[bold]bar", (4,)), ("x[/]", (2,))])
    grads = np.random.default_rng(0).normal(size=(2, 3, 6)).astype(np.float32)
    path = write_capture(tmp_path / "odd[red]name", grads, layers)
    result = run_cli(capsys, "info", path)
    assert result.code == 0, result
    assert "foo[bold]bar" in result.stdout and "x[/]" in result.stdout
    assert "odd[red]name" in "".join(result.stdout.split())  # a long path wraps at 80 columns
    result = run_cli(capsys, "fit", path, "--scope", "zzz[/]")
    assert_clean_error(result, code=2)
    assert "'zzz[/]' matches no layer (layers: foo[bold]bar, x[/]" in result.stderr


def test_capture_out_onto_a_file(capsys, tmp_path):
    """Regression: 'unexpected NotADirectoryError'."""
    target = tmp_path / "a-file"
    target.write_text("x")
    result = run_cli(capsys, "capture", "--out", target, "--steps", "2")
    assert_clean_error(result, code=2)
    assert "is a file" in result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["info", "{capture}", "--csv", "/nonexistent_dir/x.csv"], "folder /nonexistent_dir"),
        (["fit", "/nonexistent", "--plot", "/nonexistent_dir/x.png"], "--plot"),
        (["fit", "/nonexistent", "--csv", "{tmp}"], "is a folder"),
        (["recommend", "/nonexistent", "--out", "/nonexistent_dir/c.json"], "--out"),
        (["report", "/nonexistent", "--out", "/nonexistent_dir/r.html"], "--out"),
        (["fit", "{capture}", "--steps", "5:2"], "STOP 2 must be greater than START 5"),
        (["info", "{rank_file}"], "pass the capture folder"),
    ],
)
def test_bad_paths_fail_before_any_analysis(capsys, tmp_path, synthetic_capture, args, message):
    """Output paths are checked when parsed: the capture ('/nonexistent') is never read."""
    path, _ = synthetic_capture
    names = {"capture": path, "tmp": tmp_path, "rank_file": path / rank_file_name(0)}
    result = run_cli(capsys, *(a.format(**names) for a in args))
    assert_clean_error(result, code=2)
    assert message in result.stderr
    assert "None" not in result.stderr


def test_analyses_of_a_running_capture_say_so(capsys, synthetic_capture):
    path, _ = synthetic_capture
    with h5py.File(path / "capture.h5", "r+") as root:
        root.attrs["status"] = "running"
    with h5py.File(path / rank_file_name(0), "r+") as f:
        f.attrs["closed"] = np.int8(0)  # its writer (this process) still runs
        f.attrs["writer_pid"] = os.getpid()
        f.attrs["hostname"] = socket.gethostname()
    result = run_cli(capsys, "fit", path, "--dist", "laplace")
    assert result.code == 0, result
    assert "running: 6 steps so far" in result.stderr
    info = run_cli(capsys, "info", path)
    assert "running" in info.stdout and "Warning" not in info.stderr


def _has_open(pid, name):
    try:
        return any(os.readlink(fd).endswith(name) for fd in Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False


def test_a_ctrl_c_lost_in_a_callback_still_stops_the_command(monkeypatch):
    """Regression: SIGINT that lands in a weakref callback (importlib's module-lock
    cleanup) was printed as "Exception ignored" and lost: the report ran on, exit 0.
    Now the handler's flag stays set and the command's end raises ``Interrupted``."""
    import signal
    import weakref

    from gradstat import cancel
    from gradstat.cli.main import unraisable_hook
    from gradstat.errors import Interrupted

    monkeypatch.setattr(sys, "unraisablehook", unraisable_hook)
    previous = signal.getsignal(signal.SIGINT)
    cancel.install()

    class Held:
        pass

    def callback(_):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C arrives while the callback runs
        time.sleep(0.1)

    try:
        held = Held()
        reference = weakref.ref(held, callback)
        del held  # the callback runs and its KeyboardInterrupt cannot propagate
        assert reference() is None and cancel.requested()
        with pytest.raises(Interrupted):
            cancel.check()
    finally:
        signal.signal(signal.SIGINT, previous)
        cancel.reset()


@pytest.mark.parametrize("command", ["replay", pytest.param("report", marks=pytest.mark.slow)])
def test_ctrl_c_is_one_error_line(tmp_path, command):
    """Regression: SIGINT ended replay and report with exit 130 and no message."""
    grads = np.random.default_rng(0).normal(size=(4, 400, 50_000)).astype(np.float32)
    path = write_capture(tmp_path / "big", grads, layer_table([("w", (250, 200))]))
    # -X faulthandler: a child that does not stop is aborted below, printing every
    # thread's stack into the failure
    argv = [sys.executable, "-X", "faulthandler", "-m", "gradstat", command, str(path)]
    if command == "report":
        argv += ["--out", str(tmp_path / "r.html")]
    process = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=interruptible,
    )
    deadline = time.time() + 120
    while time.time() < deadline and not _has_open(process.pid, rank_file_name(0)):
        time.sleep(0.2)  # until the analysis has opened the capture
    time.sleep(1)
    assert process.poll() is None, process.communicate()
    process.send_signal(signal.SIGINT)
    try:
        _, stderr = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)
        pytest.fail(f"{command} did not stop on Ctrl-C:\n{process.communicate()[1]}")
    assert process.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1] == "Error: interrupted", stderr
    assert "Traceback" not in stderr


def _killed_capture(path: Path) -> Path:
    """A capture whose writer died (SIGKILL-like, in a forked child): its rank files keep
    HDF5's "open for write" flag and open only in SWMR-read mode."""
    from gradstat.store import RankFileWriter, write_root

    layers = layer_table([("a.weight", (300, 100)), ("b.bias", (50,))])
    path.mkdir()
    write_root(path, layers, 2, "float32", {}, run_id="k" * 32)
    pid = os.fork()
    if pid == 0:
        try:
            rng = np.random.default_rng(0)
            writers = [
                RankFileWriter(path / rank_file_name(r), r, layers[-1].stop, run_id="k" * 32)
                for r in range(2)
            ]
            for step in range(4):
                for writer in writers:
                    writer.append(step, 0.5, rng.normal(size=layers[-1].stop).astype(np.float32))
        finally:
            os._exit(0)  # no close: the flag stays
    os.waitpid(pid, 0)
    return path


def _flip_byte(file: Path, at: int) -> None:
    data = bytearray(file.read_bytes())
    data[at] ^= 0xFF
    file.write_bytes(bytes(data))


def test_damaged_metadata_of_a_killed_capture_answers_in_seconds(tmp_path, monkeypatch, capsys):
    """Regression (issue 30.7): HDF5's SWMR open retried damaged metadata for over 15
    minutes. The metadata is read in a child with a time limit per file."""
    from gradstat import open_capture
    from gradstat.errors import DataError

    path = _killed_capture(tmp_path / "killed")
    with open_capture(path) as cap:
        assert cap.status == "interrupted" and len(cap.steps) == 4
    monkeypatch.setenv("GRADSTAT_OPEN_TIMEOUT", "2")
    for at in (209, 864, 1495):  # metadata bytes whose damage made HDF5 retry
        shutil.copytree(path, tmp_path / f"flip{at}")
        _flip_byte(tmp_path / f"flip{at}" / rank_file_name(1), at)
        started = time.monotonic()
        result = run_cli(capsys, "info", tmp_path / f"flip{at}")
        assert time.monotonic() - started < 20
        assert_clean_error(result, code=1)
        assert f"{tmp_path / f'flip{at}' / rank_file_name(1)}" in result.stderr
    cut = tmp_path / "cut"
    shutil.copytree(path, cut)
    os.truncate(cut / rank_file_name(0), 1024)
    started = time.monotonic()
    with pytest.raises(DataError, match=r"rank-00000.h5: "):
        open_capture(cut)
    assert time.monotonic() - started < 5


def test_ctrl_c_stops_an_open_that_hangs(tmp_path):
    """Ctrl-C during a metadata read that HDF5 retries: exit 130 at once."""
    path = _killed_capture(tmp_path / "killed")
    _flip_byte(path / rank_file_name(0), 209)
    env = {**os.environ, "GRADSTAT_OPEN_TIMEOUT": "120"}
    process = subprocess.Popen(
        [sys.executable, "-m", "gradstat", "info", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=interruptible,
        env=env,
    )
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children")
    deadline = time.time() + 120
    while time.time() < deadline and process.poll() is None and not children.read_text().strip():
        time.sleep(0.2)  # imports, then the forked child reading the damaged file
    time.sleep(1)
    assert process.poll() is None, process.communicate()
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=20)
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr


def test_two_captures_into_one_folder_at_once(tmp_path, monkeypatch):
    """Regression (issue 30.6): two captures started into one --out at the same instant
    both passed the folder check and both reported success. Creating the log file
    (O_EXCL) claims the folder: the second is refused."""
    from gradstat.capture import launch
    from gradstat.capture.launch import CaptureOptions, run_capture
    from gradstat.errors import UsageError

    out = tmp_path / "run"
    out.mkdir()
    (out / "capture.log").write_text("the other capture's log\n")
    monkeypatch.setattr(launch, "check_folder", lambda *a: None)  # both passed the check
    options = CaptureOptions(workload="digits", steps=2, nproc_per_node=1, out=out, command="t")
    with pytest.raises(UsageError, match="being written by another capture"):
        run_capture(options)
    assert (out / "capture.log").read_text() == "the other capture's log\n"


def test_a_learner_killed_by_a_signal_is_named():
    """Regression (issue 30.10): a SIGKILLed learner was reported as gloo's "Connection
    closed by peer" of the learners that survived it."""
    from collections import deque

    from gradstat.capture.launch import failure_reason

    tail = deque(
        [
            "[rank0]: RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer",
            "Root Cause (first observed failure):",
            "[0]:",
            "  rank      : 1 (local_rank: 1)",
            "  exitcode  : -9 (pid: 4242)",
            "  traceback : Signal 9 (SIGKILL) received by PID 4242",
        ]
    )
    assert failure_reason(tail) == "learner 1 died (signal 9, SIGKILL)"
    assert failure_reason(deque(["[rank1]: ValueError: bad batch"])) == "ValueError: bad batch"


def test_bad_inputs_are_refused(capsys, synthetic_capture):
    """Regression (issue 30.12): these were read silently (k = 1, all steps, all
    learners, "."), ran with a meaningless threshold, or exited 1 for bad usage."""
    path, _ = synthetic_capture
    cases = [
        (["similarity", path, "--ratios", "1e-12"], "keeps less than one of the 580"),
        (["fit", path, "--ratios", "1e-12"], "keeps less than one"),
        (["similarity", path, "--steps", ""], "--steps is empty"),
        (["similarity", path, "--learners", ""], "--learners is empty"),
        (["fit", path, "--hard", "-1"], "hard threshold -1"),
        (["fit", path, "--hard", "nan"], "hard threshold nan"),
        (["info", "/nonexistent/capture"], "no such file or folder"),
        (["info", ""], "CAPTURE is empty"),
    ]
    for args, message in cases:
        result = run_cli(capsys, *args)
        assert_clean_error(result, code=2)
        assert message in result.stderr, (args, result)


def test_jobs_are_capped_at_the_cpus(capsys, synthetic_capture, monkeypatch):
    # one CPU here: the capped run is this process's own (no worker pool to start;
    # test_distributed.py runs the commands in --jobs 2 workers)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    path, _ = synthetic_capture
    result = run_cli(capsys, "similarity", path, "--jobs", "1000", "--json")
    assert result.code == 0, result
    assert "--jobs 1000: this process may use 1 CPUs; running 1 workers" in result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["similarity", "{capture}", "--ratios", "0"], "--ratios 0: each ratio is a density"),
        (["fit", "{capture}", "--ratios", "0.1,x"], "--ratios 0.1,x: each ratio is a density"),
        (["replay", "{capture}", "--seed", "abc"], "--seed abc: expected a whole number"),
        (["replay", "{capture}", "--beta", "x"], "--beta x: expected a number"),
        (["similarity", "{capture}", "--on", "foo"], "--on foo: 'foo' is not one of"),
        (["replay", "{capture}", "--bandwidth", "10x"], "--bandwidth '10x': expected a rate"),
    ],
)
def test_bad_values_are_named_in_plain_words(capsys, synthetic_capture, args, message):
    """Regression: 'Invalid value for '--ratios': Value error, ...' and 'Input should be a
    valid integer, unable to parse string as an integer': the validation library's text."""
    path, _ = synthetic_capture
    result = run_cli(capsys, *(a.format(capture=path) for a in args))
    assert_clean_error(result, code=2)
    assert f"Error: {message}" in result.stderr
    assert "Value error" not in result.stderr and "Input should" not in result.stderr


@pytest.mark.parametrize("args", [["info", "{capture}"], ["info", "{capture}", "--json"], ["-h"]])
def test_a_reader_that_stops_early_is_no_error(synthetic_capture, args):
    """Regression: `gradstat info CAP | head -3` exited 1, the code of bad data. The pipe
    here is closed before gradstat writes, so its first write fails every time."""
    path, _ = synthetic_capture
    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    read, write = os.pipe()
    os.close(read)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "gradstat", *(a.format(capture=path) for a in args)],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            timeout=120,
        )
    finally:
        os.close(write)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
