"""A full disk is an error, never lost data (issue 40.3).

A capture whose disk another process fills mid-run ends with one ``Error:`` line naming
the folder and its free space, exit 1, and every committed row readable: the writers
stop before the disk is full, write no note where there is no room for one (a note cut
short damages a rank file's metadata), and ``capture.h5`` is replaced only whole
(gradstat/atomic.py). That test needs a real full disk: a 16 MB tmpfs mounted here
(root only; skipped elsewhere). The output files (``--csv``, ``--plot``, ``report
-o``) are tested on a disk that is full for the command's process, simulated with a
file-size limit (``RLIMIT_FSIZE``, SIGXFSZ ignored: writes fail with EFBIG), which
works everywhere: one ``Error:`` line naming the file, exit 1, and no file, whole or
partial, left behind; an older file of that name stays as it was.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from gradstat.atomic import replacing
from gradstat.errors import DataError
from gradstat.store import layer_table, open_capture, write_capture
from gradstat.store.schema import ROOT_FILE, rank_file_name

ROOT = Path(__file__).parent.parent


@contextlib.contextmanager
def tmpfs(folder: Path, size: str):
    """A tmpfs of ``size`` mounted at ``folder`` (skips the test where that is refused)."""
    folder.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): needs root")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def _fill(folder: Path) -> Path:
    """Write zeros into ``folder`` until its disk is full; the file written."""
    filler = folder / "filler"
    block = bytes(1 << 16)
    with contextlib.suppress(OSError), open(filler, "wb") as f:
        while True:
            f.write(block)
            f.flush()
    return filler


# slow: test_capture_faults.py::test_full_disk_is_reported_with_what_was_recorded covers it
@pytest.mark.slow
def test_a_disk_filled_by_another_process_mid_capture(tmp_path):
    """Regression: a capture into a 20 MB tmpfs filled by another process exited 0
    ("join it to node 0's folder"), and then every command said capture.h5 "cannot be
    read": finalising the root on the full disk had cut it short, and the rank files'
    "stopped" note damaged their attribute heap."""
    with tmpfs(tmp_path / "disk", "16m") as disk:
        out = disk / "run"
        argv = [sys.executable, "-m", "gradstat", "capture", "--workload", "digits"]
        argv += ["--steps", "40", "--nproc-per-node", "2", "--out", str(out)]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        process = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        rank = out / rank_file_name(1)
        deadline = time.time() + 240
        while time.time() < deadline and process.poll() is None:
            if rank.exists() and rank.stat().st_size > 1_500_000:  # about 10 rows
                break
            time.sleep(0.05)
        filler = _fill(disk)
        stdout, stderr = process.communicate(timeout=300)
        assert process.returncode == 1, stderr
        errors = [line for line in stderr.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1 and "Traceback" not in stderr, stderr
        assert str(out) in errors[0] and "B free in" in errors[0], errors
        assert "captured" not in stdout and "join it" not in stdout
        filler.unlink()
        with open_capture(out, allow_damaged=True) as cap:  # the root and rows are sound
            assert cap.status in ("incomplete", "interrupted") and not cap.damage
            assert len(cap.steps) >= 5
            for _, grads in cap.iter_steps():
                assert np.isfinite(grads.numpy()).all()
        assert f"{len(cap.steps)} steps x 2 learners recorded in {out}" in errors[0]
        assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []


def _limited(limit: int):
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def _gradstat(args: list[str], limit: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gradstat", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        preexec_fn=_limited(limit),
        check=False,
    )


@pytest.fixture(scope="module")
def capture(tmp_path_factory) -> Path:
    rng = np.random.default_rng(0)
    grads = rng.laplace(size=(2, 3, 2000)).astype(np.float32)
    layers = layer_table([(f"layer{i}.weight", (100,)) for i in range(20)])
    return write_capture(tmp_path_factory.mktemp("full") / "cap", grads, layers)


@pytest.mark.parametrize(
    ("option", "args", "name"),
    [
        ("--csv", ["info", "{cap}", "--csv", "{out}"], "layers.csv"),
        pytest.param(
            "--plot",
            ["similarity", "{cap}", "--ratios", "0.1", "--plot", "{out}"],
            "s.png",
            marks=pytest.mark.slow,  # the same atomic writer as --csv (test_full_disk below)
        ),
    ],
    ids=["csv", "plot"],
)
def test_an_output_onto_a_full_disk_leaves_nothing(capture, tmp_path, option, args, name):
    out = tmp_path / name
    args = [a.format(cap=capture, out=out) for a in args]
    done = _gradstat(args, 200)  # bytes per file: less than any of these outputs
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith(f"Error: {option} {out}: cannot write (File too large")
    assert "B free in" in lines[-1] and "Traceback" not in done.stderr
    assert os.listdir(tmp_path) == []  # no partial file, no temporary one
    out.write_text("the older file\n")
    assert _gradstat(args, 200).returncode == 1
    assert out.read_text() == "the older file\n"  # a failed write leaves it as it was
    assert _gradstat(args, 1 << 30).returncode == 0 and out.stat().st_size > 200


@pytest.mark.slow  # a whole report (the tests above cover the writes of --csv, --plot)
def test_a_report_onto_a_full_disk_leaves_nothing(capture, tmp_path):
    out = tmp_path / "report.html"
    done = _gradstat(["report", capture, "-o", out, "--compressors", "fp16"], 100_000)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(f"Error: --out {out}: cannot write")
    assert os.listdir(tmp_path) == []


def test_a_root_file_replaced_on_a_full_disk_stays_as_it_was(capture, tmp_path):
    """``capture.h5`` is replaced whole or not at all: the finalising of a capture on
    a full disk leaves the old root, and its rows, readable (in a child limited to
    files of 1 KB, where the new root cannot be written)."""
    import shutil

    from gradstat.store.writer import finalize_root

    copy = tmp_path / "cap"
    shutil.copytree(capture, copy)
    before = (copy / ROOT_FILE).read_bytes()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 3
        try:
            _limited(1024)()
            finalize_root(copy, "incomplete")
        except DataError as exc:
            code = 0 if "File too large" in str(exc) else 4
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    assert (copy / ROOT_FILE).read_bytes() == before
    assert sorted(os.listdir(copy)) == [ROOT_FILE, rank_file_name(0), rank_file_name(1)]
    with open_capture(copy) as cap:
        assert cap.status == "complete" and len(cap.steps) == 3


def test_replacing_writes_whole_files_with_the_usual_permissions(tmp_path):
    target = tmp_path / "out.txt"
    with replacing(target) as handle:
        handle.write(b"written")
        assert os.listdir(tmp_path) == []  # nameless until it is whole
    assert target.read_bytes() == b"written"
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask
    with pytest.raises(RuntimeError), replacing(target) as handle:
        handle.write(b"half")
        raise RuntimeError("the figure failed")
    assert target.read_bytes() == b"written" and os.listdir(tmp_path) == ["out.txt"]
