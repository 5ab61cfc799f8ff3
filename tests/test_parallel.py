"""The unit runner: this process, --jobs workers, progress, errors, Ctrl-C, threads."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading

import numpy as np
import pandas as pd
import pytest

from gradstat import cancel, threads
from gradstat.analysis.compute import Compute
from gradstat.analysis.overlap import OverlapParams, overlap
from gradstat.capture.launch import CaptureOptions, worker_env
from gradstat.compressors import REGISTRY, Entry
from gradstat.compressors.cost import Link
from gradstat.compressors.topk import TopK
from gradstat.errors import DataError, GradstatWarning, Interrupted, UsageError
from gradstat.parallel import Task, run_units
from gradstat.parallel.pool import WorkerDied
from gradstat.parallel.units import Outcome, finish
from gradstat.store import layer_table, open_capture, write_capture


@pytest.fixture
def small_cap(tmp_path):
    grads = np.random.default_rng(0).normal(size=(2, 6, 40)).astype(np.float32)
    with open_capture(write_capture(tmp_path / "cap", grads, layer_table([("w", (40,))]))) as cap:
        yield cap


def steps_unit(cap, selection, params, compute, unit):
    """A unit for these tests: the sum of learner 0's row at step ``unit``."""
    if unit == params.get("fail_at"):
        raise DataError(f"step {unit} is damaged")
    if unit == params.get("die_at"):
        os._exit(3)
    if unit == params.get("interrupt_at"):  # Ctrl-C reaches the command's process
        worker = multiprocessing.parent_process() is not None
        os.kill(os.getppid() if worker else os.getpid(), signal.SIGINT)
        for _ in range(1000):  # Ctrl-C reaches the unit at its next check
            cancel.check()
            threading.Event().wait(0.01)
    if params.get("warn"):
        import warnings

        warnings.warn("a gap", GradstatWarning, stacklevel=1)
    return [{"step": unit, "sum": float(cap.read_row(cap.steps[unit], 0).sum())}]


def _run(cap, jobs, **params):
    task = Task(steps_unit, str(cap.path), None, params)
    return run_units(cap, task, list(range(len(cap.steps))), Compute(jobs=jobs))


def test_finish_reemits_each_warning_once_then_raises_the_first_error():
    outcomes = [
        Outcome([{"a": 1}], [(GradstatWarning, "gap")]),
        Outcome([{"a": 2}], [(GradstatWarning, "gap")]),
        Outcome(error=DataError("step 3 is damaged")),
        Outcome(error=UsageError("later")),
    ]
    with pytest.warns(GradstatWarning, match="gap") as caught:
        assert finish(outcomes[:2]) == [{"a": 1}, {"a": 2}]
    assert len(caught) == 1
    with pytest.warns(GradstatWarning, match="gap") as caught, pytest.raises(DataError, match="3"):
        finish(outcomes)
    assert len(caught) == 1


def test_an_error_that_cannot_travel_is_named():
    class Local(Exception):  # defined here: a pickle cannot find it again
        pass

    assert repr(Outcome(error=Local("singular")).portable().error) == (
        "RuntimeError('Local: singular')"
    )


@pytest.mark.parametrize("jobs", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_records_warnings_and_errors_are_the_same_in_every_mode(small_cap, jobs):
    expected = [
        {"step": i, "sum": float(small_cap.read_row(s, 0).sum())}
        for i, s in enumerate(small_cap.steps)
    ]
    with pytest.warns(GradstatWarning, match="a gap") as caught:
        assert _run(small_cap, jobs, warn=True) == expected
    assert len(caught) == 1
    with pytest.raises(DataError, match="step 4 is damaged"):
        _run(small_cap, jobs, fail_at=4)


def test_a_worker_that_dies_is_one_error(small_cap):
    with pytest.raises(WorkerDied, match="worker process stopped"):
        _run(small_cap, 2, die_at=1)


@pytest.mark.parametrize("jobs", [1, 2])
def test_ctrl_c_stops_the_units_with_interrupted(small_cap, jobs, monkeypatch):
    previous = signal.getsignal(signal.SIGINT)
    cancel.install()
    try:
        with pytest.raises(Interrupted):
            _run(small_cap, jobs, interrupt_at=1)
    finally:
        signal.signal(signal.SIGINT, previous)
        cancel.reset()


def test_unit_threads_default_to_one(monkeypatch):
    monkeypatch.delenv(threads.THREADS_ENV, raising=False)
    assert threads.unit_threads() == 1
    monkeypatch.setenv(threads.THREADS_ENV, "3")
    assert threads.unit_threads() == 3


def test_capture_learners_share_the_cpus_even_if_omp_is_set(monkeypatch, tmp_path):
    """Regression: an inherited OMP_NUM_THREADS used to give every learner all cores."""
    monkeypatch.setenv("OMP_NUM_THREADS", "64")
    monkeypatch.delenv("GRADSTAT_THREADS", raising=False)
    options = CaptureOptions(workload="digits", nproc_per_node=2, out=tmp_path / "c")
    env = worker_env(options)
    expected = str(max(1, threads.available_cpus() // 2))
    assert env["OMP_NUM_THREADS"] == env["GRADSTAT_THREADS"] == expected
    monkeypatch.setenv("GRADSTAT_THREADS", "3")
    assert worker_env(options)["OMP_NUM_THREADS"] == "3"


# slow: the other --jobs 2 tests here run units in two workers in make test
@pytest.mark.slow
def test_many_quick_units_in_two_workers_finish(tmp_path):
    # the same bug end to end: 400 step pairs, each answered in milliseconds (run in a
    # thread: a hang fails the test instead of stopping the suite)
    grads = np.random.default_rng(0).normal(size=(2, 401, 50)).astype(np.float32)
    cap = open_capture(write_capture(tmp_path / "cap", grads, layer_table([("w", (50,))])))
    params = OverlapParams(ratios=0.1)
    results = {}

    def run(jobs: int) -> None:
        results[jobs] = overlap(cap, params=params, compute=Compute(jobs=jobs))

    for jobs in (2, 1):
        thread = threading.Thread(target=run, args=(jobs,), daemon=True)
        thread.start()
        thread.join(timeout=120)
        assert not thread.is_alive(), f"jobs={jobs} did not finish"
    pd.testing.assert_frame_equal(results[2], results[1])


#: The messages :class:`CountedTopK` compressed in this process.
COMPRESSED: list[str] = []


class CountedTopK(TopK):
    """A user's top-k, registered as users register one: it notes each message it
    compresses (:data:`COMPRESSED`)."""

    def compress(self, tensor, name):
        COMPRESSED.append(name)
        return super().compress(tensor, name)


@pytest.mark.parametrize("jobs", [1, 2])
def test_replay_progress_moves_with_each_step_of_a_unit(tmp_path, monkeypatch, jobs):
    """A replay unit is every step of its compressors: the progress iterable yields once
    a step (in this process as each is replayed, or from a worker), its length counts
    the steps, and the records are those of a run without a display. In this process
    (``jobs=1``) each step is told after its messages were compressed and before the
    unit's later steps are (counted by a registered user compressor, whose messages are
    the ones a user sees go by)."""
    from gradstat.analysis.replay import Replay, ReplayParams
    from gradstat.analysis.selection import Selection

    steps, learners = 5, 2
    grads = np.random.default_rng(1).laplace(size=(learners, steps, 300)).astype(np.float32)
    cap = open_capture(write_capture(tmp_path / "cap", grads, layer_table([("w", (300,))])))
    entry = Entry(lambda ctx: CountedTopK(ctx.k), False, "a user's counted top-k")
    monkeypatch.setitem(REGISTRY, "counted-topk", entry)
    COMPRESSED.clear()
    # worker processes start afresh, without this process's registrations
    names = "counted-topk,dgc" if jobs == 1 else "topk,dgc"
    params = ReplayParams(names, [0.1], Link(1.25e9, 5e-6))
    seen: list[int] = []

    def progress(items):
        length = len(items)
        for item in items:
            seen.append(len(COMPRESSED))
            yield item
        seen.append(length)

    run = Replay(cap, Selection.of(cap), params, compute=Compute(jobs=jobs))
    records = run.run(progress)
    units = 2 if jobs == 2 else 1
    assert seen[-1] == units * steps and len(seen) == units * steps + 1
    if jobs == 1:  # told of each step after it was replayed, before the unit was done
        told = seen[:steps]
        assert all(n >= learners * (i + 1) for i, n in enumerate(told))
        assert told[0] < learners * steps and len(COMPRESSED) == learners * steps
    quiet = Replay(cap, Selection.of(cap), params, compute=Compute(jobs=1)).run()
    pd.testing.assert_frame_equal(
        records.drop(columns="compress_seconds"), quiet.drop(columns="compress_seconds")
    )
