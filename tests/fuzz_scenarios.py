"""Issue 40's command-line fault families, each run as a new user would, for
benchmarks/fuzz_captures.py (the families' own tests are in tests/test_*.py).

Each scenario runs ``python -m gradstat ...`` in a fresh process and returns
``(outcome, detail)``, ``outcome`` one of:

* ``error``: the fault ended in one ``Error:`` line with the right exit code, and left
  nothing behind (no code of the capture ran, no scratch, no process, no partial file);
* ``same``: the command did what it does on a sound input (text shown escaped);
* ``silent wrong``: it succeeded where it must not have, or showed raw control
  characters; ``code ran``: a capture's code ran; ``left behind``: scratch, a partial
  file or a process outlived the command;
* ``unexpected``: an ``Error: unexpected ...`` line (an exception nobody named);
  ``traceback``; ``unnamed error`` (exit code or line count wrong); ``hang``;
  ``signal`` (the process died by a signal it should have handled).

Families: ``code`` (a capture names code), ``signals`` (SIGINT, SIGTERM, SIGHUP, SIGKILL
mid-run, scratch and ``--jobs``), ``full disk`` (``--csv``, ``--plot`` onto a disk full
for the process: RLIMIT_FSIZE), ``patterns`` (``--scope`` regexes that backtrack),
``text`` (control characters in names and attributes, formula cells in CSV).
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import h5py
import numpy as np

from gradstat.store import layer_table, write_capture
from gradstat.store.schema import ROOT_FILE, rank_file_name
from gradstat.store.writer import RankFileWriter, finalize_root, write_root

ROOT = Path(__file__).resolve().parent.parent
ZEN = "Beautiful is better than ugly"
Scenario = tuple[str, str, Callable[[], tuple[str, str]]]


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", **extra}
    env.pop("GRADSTAT_SCRATCH", None)
    return env


def _default_signals() -> None:
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


def run(args: list, timeout: float, env: dict | None = None, limit: int | None = None):
    """``gradstat ARGS`` in a fresh process: (exit code, stdout, stderr), or None on a hang."""

    def start() -> None:
        _default_signals()
        if limit is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    try:
        done = subprocess.run(
            [sys.executable, "-m", "gradstat", *map(str, args)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env or _env(),
            preexec_fn=start,
            cwd="/",
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None
    return done.returncode, done.stdout, done.stderr


def judge(result, code: int, named: str = "") -> tuple[str, str]:
    """The outcome of a command that must fail with ``code`` and one ``Error:`` line
    (containing ``named``)."""
    if result is None:
        return "hang", ""
    returncode, _, stderr = result
    errors = [line for line in stderr.splitlines() if line.startswith("Error:")]
    if returncode < 0:
        return "signal", signal.Signals(-returncode).name
    if "Traceback" in stderr:
        return "traceback", stderr.strip().splitlines()[-1]
    if any(line.startswith("Error: unexpected ") for line in errors):
        return "unexpected", errors[0]
    if returncode == 0:
        return "silent wrong", "exit 0"
    if returncode != code or len(errors) != 1 or named not in errors[0]:
        return "unnamed error", f"exit {returncode}: {stderr.strip()[-200:]}"
    return "error", errors[0][:160]


# --- captures -----------------------------------------------------------------------------


LAYERS = layer_table([("encoder.layers.0.attention.weight", (20, 30)), ("head.bias", (20,))])


def small(path: Path, seed: int = 0, steps: int = 3) -> Path:
    grads = np.random.default_rng(seed).laplace(size=(2, steps, LAYERS[-1].stop))
    return write_capture(path, grads.astype(np.float32), LAYERS, meta={"seed": 0})


def compressed(path: Path, spec: str) -> Path:
    """A run as ``capture --compressor SPEC --ratio 0.1`` writes it (sent = grad)."""
    path.mkdir()
    d = LAYERS[-1].stop
    grads = np.random.default_rng(1).laplace(size=(2, 3, d)).astype(np.float32)
    meta = {"workload": "arrays", "seed": 0, "compressor": spec, "compressor_ratio": 0.1}
    write_root(path, LAYERS, 2, "float32", {**meta, "compressor_settings": "{}"})
    for rank in range(2):
        with RankFileWriter(path / rank_file_name(rank), rank, d, sent=True) as writer:
            for step in range(3):
                writer.append(step, 1.0, grads[rank, step], grads[rank, step], 8.0)
    finalize_root(path)
    return path


def planted(path: Path, marker: Path) -> Path:
    """A run whose ``compressor`` names ``evil.py`` in its own folder, a file that
    writes ``marker`` when imported (a capture shipping code)."""
    compressed(path, f"{path}/evil.py:Evil")
    (path / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "class Evil:\n"
        "    def compress(self, tensor, name):\n"
        "        return [tensor], None\n"
        "    def decompress(self, tensors, ctx):\n"
        "        return tensors[0]\n"
    )
    return path


def big(path: Path) -> Path:
    """A replay of this keeps its memories (3.2 MB each) in scratch under 2 MiB, and
    its MLE fits take seconds per step (``--jobs 2`` then has two busy workers)."""
    grads = np.random.default_rng(2).laplace(size=(4, 24, 200_000)).astype(np.float32)
    return write_capture(path, grads, layer_table([("w", (500, 400))]))


# --- families -----------------------------------------------------------------------------


def code_scenarios(folder: Path) -> Iterator[Scenario]:
    """A capture's ``compressor`` names a file it ships, or a module: nothing runs."""
    base = small(folder / "base")
    marker = folder / "MARKER"
    evil = planted(folder / "evil", marker)
    zen = compressed(folder / "zen", "this:Zen")
    for run_dir in (evil, zen):
        commands = {
            "compare": ["compare", base, run_dir],
            "report --with": ["report", base, "-o", folder / "r.html", "--with", run_dir],
        }
        for label, args in commands.items():

            def scenario(args=args, run_dir=run_dir) -> tuple[str, str]:
                result = run(args, 300)
                if marker.exists() or (result is not None and ZEN in result[1] + result[2]):
                    return "code ran", str(run_dir)
                return judge(result, 2, named="--trained-with")

            yield "code", f"{label} {run_dir.name}", scenario


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (children, their children, ...), from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pids: set[int]) -> set[int]:
    """Those of ``pids`` still running (zombies are not)."""
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            alive.add(pid)
    return alive


def _holds_scratch(pid: int, scratch: Path) -> bool:
    for pid_ in {pid, *descendants(pid)}:
        try:
            for fd in Path(f"/proc/{pid_}/fd").iterdir():
                if os.readlink(fd).startswith(str(scratch)):
                    return True
        except OSError:
            continue
    return False


def stopped(args: list, signum: int, ready: Callable[[int], bool], scratch: Path):
    """Start ``gradstat ARGS``, send ``signum`` once ``ready(pid)``; the outcome."""
    process = subprocess.Popen(
        [sys.executable, "-m", "gradstat", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(TMPDIR=str(scratch)),
        preexec_fn=_default_signals,
    )
    below: set[int] = set()
    try:
        deadline = time.time() + 300
        while time.time() < deadline and process.poll() is None and not ready(process.pid):
            time.sleep(0.1)
        if process.poll() is not None:
            return "unnamed error", f"ended before the signal: {process.communicate()[1][-200:]}"
        below = descendants(process.pid)
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        return "hang", f"no end within 120 s of {signal.Signals(signum).name}"
    deadline = time.time() + 20
    while time.time() < deadline and alive(below):
        time.sleep(0.2)
    if alive(below) or os.listdir(scratch):
        return "left behind", f"processes {sorted(alive(below))}, scratch {os.listdir(scratch)}"
    if signum == signal.SIGKILL:
        return ("error", "killed, nothing left") if process.returncode == -9 else ("signal", "")
    return judge((process.returncode, "", stderr), 128 + signum, named=_NAMES[signum])


_NAMES = {signal.SIGINT: "interrupted", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}


def signal_scenarios(folder: Path) -> Iterator[Scenario]:
    """Commands stopped mid-run: replay and recommend on scratch, fit with --jobs."""
    cap = big(folder / "big")
    replay = ["replay", cap, "--compressors", "topk", "--ratios", "0.01", "--memory", "2MiB"]
    recommend = ["recommend", cap, "--error-budget", "0.5", *replay[2:]]
    fit = ["fit", cap, "--dist", "all", "--method", "mle", "--jobs", "2", "--ratios", "0.01"]
    cases = [
        ("replay", replay, signal.SIGTERM),
        ("replay", replay, signal.SIGHUP),
        ("replay", replay, signal.SIGINT),
        ("replay", replay, signal.SIGKILL),
        ("recommend", recommend, signal.SIGTERM),
        ("recommend", recommend, signal.SIGKILL),
        ("fit --jobs 2", fit, signal.SIGTERM),
        ("fit --jobs 2", fit, signal.SIGKILL),
    ]
    for label, args, signum in cases:

        def scenario(args=args, signum=signum, label=label) -> tuple[str, str]:
            scratch = Path(tempfile.mkdtemp(dir=folder, prefix="scratch-"))
            if label.startswith("fit"):
                ready = lambda pid: len(descendants(pid)) >= 3  # noqa: E731 - 2 workers
            else:
                ready = lambda pid: _holds_scratch(pid, scratch)  # noqa: E731
            return stopped(args, signum, ready, scratch)

        yield "signals", f"{label} {signal.Signals(signum).name}", scenario


def full_disk_scenarios(folder: Path) -> Iterator[Scenario]:
    """Outputs onto a disk that is full for the command (RLIMIT_FSIZE of 64 bytes)."""
    cap = small(folder / "cap")
    outputs = {
        "--csv": ["info", cap, "--csv", "layers.csv"],
        "--plot": ["similarity", cap, "--ratios", "0.1", "--plot", "s.png"],
        "replay --csv": ["replay", cap, "--ratios", "0.1", "--csv", "r.csv"],
    }
    for label, (*args, option, name) in outputs.items():

        def scenario(args=args, option=option, name=name) -> tuple[str, str]:
            out = Path(tempfile.mkdtemp(dir=folder, prefix="out-"))
            outcome = judge(run([*args, option, out / name], 300, limit=64), 1, "cannot write")
            if os.listdir(out):
                return "left behind", str(os.listdir(out))
            return outcome

        yield "full disk", label, scenario


def pattern_scenarios(folder: Path) -> Iterator[Scenario]:
    """``--scope`` regexes that backtrack exponentially on the layer names."""
    cap = small(folder / "cap")
    for pattern in ("(.*.*)*X$", "(a|aa)*(.*)*$$X", "^(([a-z.0-9])+)+Y$"):

        def scenario(pattern=pattern) -> tuple[str, str]:
            started = time.monotonic()
            outcome = judge(run(["fit", cap, "--scope", pattern], 120), 2, named="2 s")
            return outcome[0], f"{outcome[1]} ({time.monotonic() - started:.0f} s)"

        yield "patterns", pattern, scenario


def text_scenarios(folder: Path) -> Iterator[Scenario]:
    """Control characters in layer names and attributes; formula cells in CSV."""
    names = ["conv\x1b]0;owned\x07.w", "fc\x1b[2J.w", '=HYPERLINK("x")', "@SUM(A1)", "\rcr"]
    layers = layer_table([(name, (4,)) for name in names])
    grads = np.random.default_rng(3).normal(size=(2, 2, 4 * len(names))).astype(np.float32)
    cap = write_capture(folder / "text", grads, layers, meta={"command": "\x1b[31mred"})
    with h5py.File(cap / ROOT_FILE, "r+") as f:
        f.attrs["workload"] = "w\x1b[2J"

    def info() -> tuple[str, str]:
        result = run(["info", cap], 120)
        if result is None or result[0] != 0:
            return judge(result, 0)
        raw = [c for c in "\x1b\x07\r" if c in result[1]]
        return ("silent wrong", f"raw {raw!r}") if raw else ("same", "escaped")

    def csv() -> tuple[str, str]:
        out = folder / "layers.csv"
        result = run(["info", cap, "--csv", out], 120)
        if result is None or result[0] != 0:
            return judge(result, 0)
        import pandas as pd

        cells = list(pd.read_csv(out)["name"])
        formulas = [c for c in cells if str(c)[:1] in "=+-@\t\r"]
        if formulas or len(cells) != len(names):
            return "silent wrong", f"cells {cells!r}"
        return "same", "inert"

    yield "text", "info", info
    yield "text", "--csv", csv


#: Each family's name and the function making its scenarios (and their captures).
FAMILIES = {
    "code": code_scenarios,
    "signals": signal_scenarios,
    "full disk": full_disk_scenarios,
    "patterns": pattern_scenarios,
    "text": text_scenarios,
}
