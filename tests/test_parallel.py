"""The parallel runner's parts: JSON between processes, the thread policy, capture threads."""

from __future__ import annotations

import io
import math
import os
import threading
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from gradstat.analysis.compute import Compute
from gradstat.analysis.overlap import OverlapParams, temporal_overlap
from gradstat.capture.launch import CaptureOptions, _worker_env
from gradstat.compressors.cost import Link
from gradstat.compressors.registry import parse_compressors
from gradstat.errors import DataError, GradstatWarning, UsageError
from gradstat.parallel import codec, threads
from gradstat.parallel.pool import WorkerDied, _Worker
from gradstat.parallel.runner import requested_jobs
from gradstat.parallel.units import Task, finish, resolve_function
from gradstat.store import layer_table, open_capture, write_capture


def test_typed_json_rebuilds_gradstat_dataclasses_and_tuples():
    value = {
        "specs": tuple(parse_compressors("topk,clt-k:beta=0.5")),
        "link": Link(1.25e9, 5e-6),
        "steps": (1, 2, 3),
        "ratio": math.nan,
    }
    back = codec.from_typed(codec.decode(codec.encode(codec.to_typed(value))))
    assert back["specs"] == value["specs"] and back["link"] == value["link"]
    assert back["steps"] == (1, 2, 3) and math.isnan(back["ratio"])


def test_typed_json_builds_nothing_outside_gradstat():
    with pytest.raises(ValueError, match="not a gradstat class"):
        codec.from_typed({"__dataclass__": "subprocess:Popen", "fields": {"args": "true"}})
    with pytest.raises(ValueError, match="not a gradstat unit function"):
        resolve_function("os:system")


def test_finish_reemits_each_warning_once_then_raises_the_first_error():
    outcomes = [
        {"records": [{"a": 1}], "warnings": [["GradstatWarning", "gap"]]},
        {"records": [{"a": 2}], "warnings": [["GradstatWarning", "gap"]]},
        {"error": {"type": "DataError", "message": "step 3 is damaged"}, "warnings": []},
        {"error": {"type": "UsageError", "message": "later"}, "warnings": []},
    ]
    with pytest.warns(GradstatWarning, match="gap") as caught:
        assert finish(outcomes[:2]) == [{"a": 1}, {"a": 2}]
    assert len(caught) == 1
    with pytest.warns(GradstatWarning, match="gap") as caught, pytest.raises(DataError, match="3"):
        finish(outcomes)
    assert len(caught) == 1


def test_unit_error_of_an_unknown_type_names_it():
    with pytest.raises(RuntimeError, match="LinAlgError: singular"):
        finish([{"error": {"type": "LinAlgError", "message": "singular"}, "warnings": []}])


def test_task_message_round_trip_keeps_its_context():
    task = Task(resolve_function, "/some/capture", (0, 2), Link(1e9, 1e-6), None)
    again = Task.from_message(codec.decode(codec.encode(task.to_message())))
    assert again.function is resolve_function
    assert (again.capture, again.selection, again.params) == ("/some/capture", (0, 2), task.params)


def test_default_jobs_is_this_nodes_share_of_the_cpus(monkeypatch):
    cpus = threads.available_cpus()
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert threads.default_jobs() == cpus
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cpus + 1))
    assert threads.default_jobs() == 1
    with pytest.raises(UsageError):
        threads.check_jobs(0)


def test_worker_processes_start_where_bytes_times_cost_pay_for_them():
    # 4 steps x 8 learners x 8M float32 = 1 GiB: the threshold for one pass; a small
    # selection runs in this process unless its analysis costs many passes per byte.
    class Cap:
        numel, steps, learners = 8 << 20, range(4), range(8)

    small = SimpleNamespace(steps=[0], learners=[0])
    assert requested_jobs(Cap, small, None) == 1
    assert requested_jobs(Cap, small, None, cost=32) is None  # the default: every CPU
    assert requested_jobs(Cap, small, None, cost=31.9) == 1
    assert requested_jobs(Cap, small, 3, cost=1) == 3  # asked for: always honoured


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
    env = _worker_env(options)
    expected = str(max(1, threads.available_cpus() // 2))
    assert env["OMP_NUM_THREADS"] == env["GRADSTAT_THREADS"] == expected
    monkeypatch.setenv("GRADSTAT_THREADS", "3")
    assert _worker_env(options)["OMP_NUM_THREADS"] == "3"


def test_pool_takes_every_answer_that_arrived_together():
    # Regression: the pool read answers with a buffered readline after select(); two
    # answers arriving together were both pulled into Python's buffer, one returned, and
    # select() never woke up for the other: overlap --jobs 2 waited forever.
    read, write = os.pipe()
    worker = object.__new__(_Worker)
    worker.process = SimpleNamespace(stdout=os.fdopen(read, "rb"), wait=lambda: 0)
    worker.partial = bytearray()
    worker.log = io.BytesIO(b"the worker's last words\n")
    os.write(write, b'{"index": 0}\n{"index": 1}\n{"ind')
    assert [codec.decode(line) for line in worker.answers()] == [{"index": 0}, {"index": 1}]
    os.write(write, b'ex": 2}\n')
    assert [codec.decode(line) for line in worker.answers()] == [{"index": 2}]
    os.close(write)
    with pytest.raises(WorkerDied, match="last words"):
        worker.answers()  # end of file: the worker is gone
    worker.process.stdout.close()


def test_many_quick_units_in_two_workers_finish(tmp_path):
    # the same bug end to end: 400 step pairs, each answered in milliseconds (run in a
    # thread: a hang fails the test instead of stopping the suite)
    grads = np.random.default_rng(0).normal(size=(2, 401, 50)).astype(np.float32)
    cap = open_capture(write_capture(tmp_path / "cap", grads, layer_table([("w", (50,))])))
    params = OverlapParams(ratio=0.1)
    results = {}

    def run(jobs: int) -> None:
        results[jobs] = temporal_overlap(cap, params=params, compute=Compute(jobs=jobs))

    for jobs in (2, 1):
        thread = threading.Thread(target=run, args=(jobs,), daemon=True)
        thread.start()
        thread.join(timeout=120)
        assert not thread.is_alive(), f"jobs={jobs} did not finish"
    pd.testing.assert_frame_equal(results[2], results[1])


def test_analysis_processes_ask_numpy_for_no_huge_pages():
    # tune_allocators (the command line and its workers call it) turns numpy's
    # transparent-huge-page advice off: faults that compact memory stalled analyses
    import numpy as np

    from gradstat.parallel.allocator import tune_allocators

    switch = np._core.multiarray._set_madvise_hugepage
    before = switch(True)
    try:
        tune_allocators()
        assert switch(True) is False  # what tune_allocators left
    finally:
        switch(before)


@pytest.mark.parametrize("jobs", [1, 2])
def test_replay_progress_moves_with_each_step_of_a_unit(tmp_path, monkeypatch, jobs):
    """A replay unit is every step of its compressors: the progress display is told of
    each step as it is done (in this process or from a worker), and the parts add up to
    its length; the records are those of a run without a display."""
    from gradstat.analysis import replay as replay_module
    from gradstat.analysis.replay import Replay, ReplayParams, replay_unit
    from gradstat.analysis.selection import Selection
    from gradstat.parallel.pool import run_pool

    steps = 5
    grads = np.random.default_rng(1).laplace(size=(2, steps, 300)).astype(np.float32)
    cap = open_capture(write_capture(tmp_path / "cap", grads, layer_table([("w", (300,))])))
    params = ReplayParams("topk,dgc", [0.1], Link(1.25e9, 5e-6))
    streamed = replay_module.replay_streamed
    replayed: list[int] = []  # steps replayed so far in this process

    def counted(*args, **kwargs):
        for item in streamed(*args, **kwargs):
            replayed.append(item[0])
            yield item

    monkeypatch.setattr(replay_module, "replay_streamed", counted)
    events: list[str] = []

    def progress(items):
        events.append(f"{len(items)} units")  # a display that moves once a unit (tqdm)
        items.on_tick = lambda: events.append(f"step ({len(replayed)} replayed here)")
        length = len(items)  # now counting steps
        for item in items:
            events.append("unit")
            yield item
        events.append(f"of {length}")

    run = Replay(cap, Selection.of(cap), params, compute=Compute(jobs=jobs))
    records = run.run(progress)
    units = 2 if jobs == 2 else 1
    assert events[0] == f"{units} units" and events[-1] == f"of {units * steps}"
    assert len(events) == units * steps + 2 and events.count("unit") == units
    if jobs == 1:  # told of each step as it was replayed, not when the unit was done
        assert events[1:steps] == [f"step ({i} replayed here)" for i in range(1, steps)]
    else:  # the workers' tick lines: one a step of each unit
        compute = Compute(jobs=1)
        task = Task(replay_unit, str(cap.path), Selection.of(cap), params, compute).to_message()
        ticks: list[int] = []
        units_sent = [codec.to_typed((0,)), codec.to_typed((1,))]
        for _ in run_pool(task, units_sent, 2, 1, on_tick=ticks.append):
            pass
        assert sorted(ticks) == [0] * steps + [1] * steps
    quiet = Replay(cap, Selection.of(cap), params, compute=Compute(jobs=1)).run()
    pd.testing.assert_frame_equal(
        records.drop(columns="compress_seconds"), quiet.drop(columns="compress_seconds")
    )
