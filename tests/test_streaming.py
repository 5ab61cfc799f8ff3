"""Streaming top-k sets: column blocks give the same results as whole rows, and both
match the sets of the stacked step (the earlier, all-learners-in-memory computation)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pandas as pd
import pytest
import torch

from gradstat.analysis.buildup import BuildupParams, buildup
from gradstat.analysis.compute import MIN_BLOCK, ROWS_ALIVE, Compute
from gradstat.analysis.overlap import OverlapParams, overlap
from gradstat.analysis.row_workspace import Workspace, scope_pieces
from gradstat.analysis.selection import Selection, k_for
from gradstat.analysis.similarity import SimilarityParams, similarity
from gradstat.analysis.topk_stream import SetBuffers, stream_step_sets
from gradstat.errors import DataError
from gradstat.stats.topk_sets import energy_captured, topk_indices
from gradstat.store import Scope, layer_table, open_capture, write_capture

# 247,104 values: no layer and no scope is a multiple of the 65,536-column block
LAYERS = layer_table([("embed", (1000, 97)), ("mid", (50_003,)), ("out", (150_001,))])
D = LAYERS[-1].stop
#: The smallest budget: blocks of MIN_BLOCK columns.
SMALL = Compute(device="cpu", memory=MIN_BLOCK * 4 * ROWS_ALIVE)
WHOLE = Compute(device="cpu", memory=1 << 30)


@pytest.fixture(scope="module")
def long_capture(tmp_path_factory):
    rng = np.random.default_rng(7)
    shared = rng.standard_t(3, size=(1, 3, D))
    grads = (shared + rng.standard_t(3, size=(4, 3, D))).astype(np.float32)
    path = write_capture(tmp_path_factory.mktemp("long") / "cap", grads, LAYERS, steps=[0, 1, 2])
    return path, grads


def _sets(cap, step, learners, sc, ks, block, with_mean=True):
    """``stream_step_sets`` with buffers of its own."""
    with SetBuffers(min(block, sc.numel), torch.device("cpu"), with_mean) as buffers:
        return stream_step_sets(cap, step, learners, sc, ks, buffers, block)


def test_scope_pieces_map_local_columns_to_the_flat_vector():
    scope = Scope("a|c", ((0, 10), (30, 5), (50, 20)))
    assert list(scope_pieces(scope, 0, 35)) == [(0, 10, 0), (30, 35, 10), (50, 70, 15)]
    assert list(scope_pieces(scope, 12, 20)) == [(32, 35, 12), (50, 55, 15)]


@pytest.mark.parametrize("scope", ["model", "layers", "embed|out"])
def test_blocks_equal_whole_rows_equal_stacked_sets(long_capture, scope):
    path, grads = long_capture
    with open_capture(path) as cap:
        (sc, *_) = cap.scopes(scope)
        ks = [k_for(r, sc.numel) for r in (0.01, 0.001)]
        blocked = _sets(cap, 1, [0, 1, 2, 3], sc, ks, MIN_BLOCK)
        whole = _sets(cap, 1, [0, 1, 2, 3], sc, ks, sc.numel)
        x = sc.take(torch.from_numpy(grads[:, 1]))
    assert sc.numel > MIN_BLOCK or scope == "layers"
    for k, a, b in zip(ks, blocked, whole, strict=True):
        mean = x.mean(dim=0)
        stacked = torch.cat([topk_indices(x, k), topk_indices(mean, k)[None]])
        for sets in (a, b):
            assert _sorted(sets.indices) == _sorted(stacked)
            torch.testing.assert_close(
                sets.energy, energy_captured(mean, stacked), rtol=1e-6, atol=0
            )


@pytest.mark.parametrize("learners", [[0, 1, 2], [3, 1, 0, 2]])
def test_streamed_sets_equal_the_stacked_step(long_capture, learners):
    """In whole rows and in blocks (the rows' floors), with an odd number of rows (the
    mean goes where the last row was), the sets are those of the stacked step, and the
    file's rows are unchanged."""
    path, grads = long_capture
    with open_capture(path) as cap:
        (sc,) = cap.scopes("model")
        (k,) = ks = [k_for(0.01, sc.numel)]
        x = torch.from_numpy(grads[learners, 1])
        mean = x.mean(dim=0)
        stacked = torch.cat([topk_indices(x, k), topk_indices(mean, k)[None]])
        for block in (sc.numel, MIN_BLOCK):
            (sets,) = _sets(cap, 1, learners, sc, ks, block)
            assert _sorted(sets.indices) == _sorted(stacked)
            for learner in learners:
                assert np.array_equal(cap.read_row(1, learner), grads[learner, 1])


def test_a_floor_keeps_late_blocks_just_above_it(tmp_path):
    """The floor is the k-th largest kept so far, never more: the first two blocks hold
    k values each just above 1 (the floor becomes about 1.0005), the last block the
    row's true top k just above that (1.002-1.01); a floor set any higher would lose
    them."""
    k, d = 100, 8 * MIN_BLOCK
    rng = np.random.default_rng(3)
    grads = rng.uniform(-0.5, 0.5, size=(2, 1, d)).astype(np.float32)
    for block, low, high in ((0, 1.0, 1.001), (1, 1.0, 1.001), (7, 1.002, 1.01)):
        at = block * MIN_BLOCK + rng.choice(MIN_BLOCK, k, replace=False)
        grads[:, 0, at] = rng.uniform(low, high, size=k) * rng.choice([-1, 1], size=k)
    path = write_capture(tmp_path / "cap", grads, layer_table([("w", (d,))]))
    x = torch.from_numpy(grads[:, 0])
    stacked = torch.cat([topk_indices(x, k), topk_indices(x.mean(dim=0), k)[None]])
    assert (stacked >= 7 * MIN_BLOCK).all()
    with open_capture(path) as cap:
        (sc,) = cap.scopes("model")
        (sets,) = _sets(cap, 0, [0, 1], sc, [k], MIN_BLOCK)
    assert _sorted(sets.indices) == _sorted(stacked)


def _sorted(indices: torch.Tensor) -> list[list[int]]:
    return [sorted(row.tolist()) for row in indices]


@pytest.mark.parametrize("scope", ["model", "embed|out"])
def test_analyses_in_blocks_equal_whole_rows(long_capture, scope):
    path, _ = long_capture
    with open_capture(path) as cap:
        selection = Selection.of(cap, scope=scope)
        runs = {
            name: (
                similarity(cap, selection, SimilarityParams(0.01), compute=compute),
                buildup(cap, selection, BuildupParams("0.01,0.001"), compute=compute),
                overlap(cap, selection, OverlapParams(0.001), compute=compute),
            )
            for name, compute in (("blocks", SMALL), ("whole", WHOLE))
        }
    (sim_a, build_a, over_a), (sim_b, build_b, over_b) = runs["blocks"], runs["whole"]
    pd.testing.assert_frame_equal(sim_a.pairs, sim_b.pairs, rtol=1e-6)
    pd.testing.assert_frame_equal(sim_a.steps, sim_b.steps, rtol=1e-6)
    pd.testing.assert_frame_equal(build_a, build_b)
    pd.testing.assert_frame_equal(over_a, over_b)
    assert (sim_a.steps["union"] > k_for(0.01, D if scope == "model" else 247_004 - 50_003)).all()


def test_nonfinite_value_in_a_block_names_step_and_learner(tmp_path):
    grads = np.random.default_rng(0).normal(size=(2, 2, D)).astype(np.float32)
    grads[1, 1, D - 3] = np.nan
    path = write_capture(tmp_path / "nan", grads, LAYERS)
    with open_capture(path) as cap, pytest.raises(DataError, match="step 1, learner 1: 1 NaN"):
        similarity(cap, Selection.of(cap), SimilarityParams(0.01), compute=SMALL)


def test_buffers_kept_from_step_to_step_give_each_steps_own_sets(long_capture):
    # a unit keeps its buffers (the row, the running sum, the candidate rooms) from step
    # to step, in whatever order it asks for them: nothing of one step may leak into
    # another's sets, with or without the mean
    path, _ = long_capture
    with open_capture(path) as cap:
        (sc,) = cap.scopes("model")
        ks, learners = [k_for(0.001, sc.numel)], [0, 1, 2, 3]
        for with_mean in (True, False):
            fresh = {s: _sets(cap, s, learners, sc, ks, sc.numel, with_mean) for s in (0, 1, 2)}
            with SetBuffers(sc.numel, torch.device("cpu"), with_mean) as buffers:
                for step in (0, 1, 0, 2, 2, 1):
                    (got,) = stream_step_sets(cap, step, learners, sc, ks, buffers, sc.numel)
                    assert torch.equal(got.indices, fresh[step][0].indices), step
                    if with_mean:
                        assert torch.equal(got.energy, fresh[step][0].energy), step


def test_work_after_each_read_runs_in_learner_order_on_the_reading_thread(long_capture):
    """``rows(after=...)`` hands out (row, after(row)); the reading thread runs ``after`` in
    learner order (replay's reference sum depends on the order of its adds)."""
    path, grads = long_capture
    seen = []

    def after(row):
        seen.append(threading.current_thread().name)
        return float(row.sum(dtype=np.float64))

    with open_capture(path) as cap:
        (sc,) = cap.scopes("model")
        with Workspace() as space:
            space.ensure(sc.numel)
            got = list(space.rows(cap, 2, [3, 1, 0], sc, 0, sc.numel, after=after))
            np.testing.assert_array_equal(got[-1][0], grads[0, 2])  # earlier buffers reused
            expected = [float(grads[i, 2].sum(dtype=np.float64)) for i in (3, 1, 0)]
            assert [total for _, total in got] == expected
            assert all(name.startswith("gradstat-read") for name in seen)
            # the next step's first row read ahead (replay): only read while the caller
            # may still use what after() writes; its after() runs when the next call
            # takes it, first in line, and the rows are the next step's
            first = list(space.rows(cap, 1, [3, 1, 0], sc, 0, sc.numel, (2, 0, sc.numel), after))
            assert [total for _, total in first] == [
                float(grads[i, 1].sum(dtype=np.float64)) for i in (3, 1, 0)
            ]
            time.sleep(0.3)  # the read ahead has landed
            assert len(seen) == 6  # read, after() not run
            second = list(space.rows(cap, 2, [3, 1, 0], sc, 0, sc.numel, after=after))
            assert [total for _, total in second] == expected
            assert len(seen) == 9 and all(name.startswith("gradstat-read") for name in seen)
