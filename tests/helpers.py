"""Test helpers: run the CLI in-process or as a real subprocess, and torchrun scripts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from gradstat.cli.main import main

TESTS = Path(__file__).parent


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str


def interruptible() -> None:
    """``preexec_fn`` for a child that a test interrupts: SIGINT's default disposition.
    A test run started in the background of a script (``make test &``) inherits SIGINT
    ignored, and Python then installs no KeyboardInterrupt handler in the child."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_cli(capsys: pytest.CaptureFixture, *args: str) -> Result:
    """Run ``gradstat ARGS`` in this process; returns exit code and captured output."""
    capsys.readouterr()
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out = capsys.readouterr()
    return Result(code, out.out, out.err)


def assert_clean_error(result: Result, code: int | None = None) -> None:
    """One ``Error:`` line, non-zero exit, no traceback."""
    assert result.code != 0, result
    if code is not None:
        assert result.code == code, result
    assert "Error:" in result.stderr, result
    assert "Traceback" not in result.stderr + result.stdout, result


def torchrun(
    script: Path, *args: str, nproc: int = 2, timeout: int = 300
) -> subprocess.CompletedProcess:
    """Run a script under ``torch.distributed.run`` with gloo learners on this machine;
    ``timeout`` only stops a hang (generous: make test runs two test files at a time)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        str(script),
        *args,
    ]
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, env=env, check=False
    )
