"""The streamed lockstep replay against the plain whole-step reference of every
compressor (tests/reference_compressors.py), message by message at every granularity,
and its scratch file."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from gradstat.analysis.ef_store import SCRATCH_ENV, MemoryRows, RamRows
from gradstat.analysis.replay import capture_plan
from gradstat.analysis.replay_records import error_sums, ratios
from gradstat.analysis.replay_stream import replay_streamed
from gradstat.compressors import REGISTRY, build_scheme, parse_compressors
from gradstat.compressors.exchange import Call, Sent, SparseRow, dense
from gradstat.compressors.memory import DGCMemory
from gradstat.errors import DataError
from gradstat.store import layer_table, open_capture, write_capture
from tests.reference_compressors import Reference

LEARNERS, STEPS = 4, 5
NAMES = [*REGISTRY, "clt-k:beta=0.5", "dgc:momentum=0.5"]


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    """4 learners x 5 steps; two matrices (PowerSGD compresses both) and a bias."""
    rng = np.random.default_rng(3)
    layers = layer_table([("w", (40, 50)), ("b", (40,)), ("w2", (30, 20))])
    d = layers[-1].stop
    shared = rng.laplace(size=(1, STEPS, d))
    grads = (shared + 0.5 * rng.laplace(size=(LEARNERS, STEPS, d))).astype(np.float32)
    return write_capture(tmp_path_factory.mktemp("stream") / "cap", grads, layers)


def _scheme(cap, name, granularity="model"):
    (spec,) = parse_compressors(name)
    scope = cap.scopes("model")[0]
    ratio = None if spec.fixed_rate else 0.05
    plan = capture_plan(cap, scope, granularity)
    return scope, build_scheme(spec, ratio, plan, seed=0)


def _references(scheme, n=LEARNERS):
    """One plain whole-step reference per message of the scheme's plan."""
    return [
        Reference(
            scheme.spec.name,
            scheme.spec.params,
            scheme.ratio,
            scheme.k(m),
            message.numel,
            list(message.shapes),
            0,
            n,
            message=m,
        )
        for m, message in enumerate(scheme.plan.messages)
    ]


def _columns(grads: torch.Tensor, message) -> torch.Tensor:
    return torch.cat([grads[:, o : o + k] for o, k in message.slices], dim=1)


def _check(name, cap, stream, scheme, references, exact=True):
    for step in cap.steps:
        grads = cap.read_step(int(step))
        got_step, [result] = next(stream)
        assert got_step == step
        assert sorted(o.index for o in result.messages) == list(range(len(references)))
        for outcome, reference in zip(result.messages, result.references, strict=True):
            message = scheme.plan.messages[outcome.index]
            whole = references[outcome.index]
            g = _columns(grads, message)
            want = whole.step(g, int(step))
            if exact:
                assert torch.equal(dense(outcome.estimate), want.estimate), (name, message.name)
            else:  # sums over learners in another order (PowerSGD's, gTop-k's tree)
                torch.testing.assert_close(dense(outcome.estimate), want.estimate)
            torch.testing.assert_close(reference, whole.reference(g.mean(dim=0)))
            norm = sum(math.sqrt(s) for s in outcome.squares) / len(outcome.squares)
            assert norm == pytest.approx(
                want.memory_norm, rel=1e-6 if name == "powersgd" else 1e-12
            )
            assert outcome.union == want.union
            assert outcome.selected == want.selected
            got = [(t.collective, t.nbytes) for t in outcome.transfers]
            assert got == [(c, pytest.approx(b)) for c, b in want.transfers], name
            info = outcome.info or {}
            for key in ("threshold", "stages"):
                if key in want.info:
                    assert info[key] == pytest.approx(want.info[key])


@pytest.mark.parametrize("name", NAMES)
def test_streamed_step_equals_whole_step_reference(capture, name):
    """At model granularity every compressor gives the aggregate, memory norm, union,
    selections and bytes of the plain whole-step reference on the stacked step, bit for
    bit (PowerSGD's and gTop-k's aggregates to rounding: their sums over learners go in
    another order), in RAM and on scratch."""
    with open_capture(capture) as cap:
        for scratch in (False, True):
            scope, scheme = _scheme(cap, name)
            stream = replay_streamed(
                cap, list(cap.steps), cap.learners, [(scope, scheme)], scratch=scratch
            )
            _check(
                name,
                cap,
                stream,
                scheme,
                _references(scheme),
                exact=name not in ("powersgd", "gtopk"),
            )


@pytest.mark.parametrize("granularity", ["tensor", "bucket:0.002"])
@pytest.mark.parametrize(
    "name", ["topk", "randomk", "threshold", "clt-k", "gtopk", "qsgd", "powersgd", "signsgd", "dgc"]
)
def test_every_message_is_its_own_compressor(capture, name, granularity):
    """Per tensor and per DDP bucket, every message replays as a plain whole-step
    reference on that message's columns alone (its own k, memory, draws and leader);
    PowerSGD compresses each matrix in its shape per tensor and sends the bias dense."""
    with open_capture(capture) as cap:
        scope, scheme = _scheme(cap, name, granularity)
        assert len(scheme.plan.messages) > 1
        stream = replay_streamed(cap, list(cap.steps), cap.learners, [(scope, scheme)])
        _check(
            name, cap, stream, scheme, _references(scheme), exact=name not in ("powersgd", "gtopk")
        )


def test_a_window_of_steps_equals_the_same_steps_of_a_whole_replay(capture):
    """Random draws follow the recorded step, not the call count: replaying steps 2..4
    alone gives step 2's numbers of a whole replay (no memory: nothing else carries)."""
    with open_capture(capture) as cap:
        for name in ("qsgd", "terngrad", "randomk+none", "dgc+none"):
            whole, window = (_scheme(cap, name, "tensor") for _ in range(2))
            steps = list(cap.steps)
            full = dict(replay_streamed(cap, steps, cap.learners, [whole]))
            part = dict(replay_streamed(cap, steps[2:], cap.learners, [window]))
            for step in steps[2:]:
                for a, b in zip(full[step][0].messages, part[step][0].messages, strict=True):
                    assert torch.equal(dense(a.estimate), dense(b.estimate)), name


def test_streamed_topk_of_long_rows_equals_whole_step(tmp_path):
    """Rows long enough for top-k's sampled pre-filter: the same aggregate, selections
    and memory norm as the whole-step reference."""
    rng = np.random.default_rng(5)
    layers = layer_table([("w", (70_001,))])
    grads = rng.laplace(size=(3, 3, 70_001)).astype(np.float32)
    path = write_capture(tmp_path / "cap", grads, layers)
    with open_capture(path) as cap:
        scope, scheme = _scheme(cap, "topk")
        scheme = build_scheme(scheme.spec, 0.01, scheme.plan)
        stream = replay_streamed(cap, list(cap.steps), cap.learners, [(scope, scheme)])
        _check("topk", cap, stream, scheme, _references(scheme, 3))
        stream.close()


def test_scratch_files_have_no_name_even_while_in_use(tmp_path, monkeypatch):
    """The scratch file has no name in the folder (so no death can leave it there),
    yet holds its rows; its space is the process's until it closes the file."""
    monkeypatch.setenv(SCRATCH_ENV, str(tmp_path))
    with pytest.raises(RuntimeError), MemoryRows(scratch=True) as rows:
        store = rows.new(3, 1000)
        row = torch.arange(1000, dtype=torch.float32)
        store.save(1, row)
        assert torch.equal(store.load(1), row) and not store.load(0).any()
        assert os.listdir(tmp_path) == []
        assert os.fstat(store.fd).st_nlink == 0 and os.fstat(store.fd).st_size == 12_000
        raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == [] and store.fd == -1


def test_nonfinite_row_names_step_and_learner(tmp_path):
    grads = np.ones((3, 2, 100), dtype=np.float32)
    grads[2, 1, 7] = np.nan
    path = write_capture(tmp_path / "nan", grads, layer_table([("w", (100,))]))
    with open_capture(path) as cap, pytest.raises(DataError, match="step 1, learner 2"):
        list(replay_streamed(cap, [0, 1], [0, 1, 2], [_scheme(cap, "topk")]))


@pytest.mark.parametrize("scratch", [False, True])
def test_dgc_sparse_update_equals_dense_update(scratch):
    """DGC's memories after a sparse payload equal those after the same payload dense,
    also where a sent value is 0 (``u`` is not zeroed there) or -0.0."""
    rng = np.random.default_rng(5)
    g = torch.from_numpy(rng.standard_normal((2, 64)).astype(np.float32))
    index = torch.tensor([3, 10, 17, 40])
    call = Call("w", 0, 0, 0, 1, shape=(64,))
    plan = capture_plan_of(64)
    with MemoryRows(scratch) as rows:
        memories = {"dense": DGCMemory(0.5), "sparse": DGCMemory(0.5)}
        for memory in memories.values():
            memory.allocate(1, plan, rows.new)
            handle = memory.open(0, 0)
            p = memory.compensate(handle, call, g[0])  # a first step fills u and v
            memory.update(handle, call, p, Sent(torch.zeros(64), None, (), 0), None)
            memory.close(0, 0, handle)
        norms = {}
        for kind, memory in memories.items():
            handle = memory.open(0, 0)
            p = memory.compensate(handle, call, g[1])
            values = p[index].clone()
            values[1], values[2] = 0.0, -0.0  # sent as zeros: not masked
            sent = SparseRow(64, index, values)
            sent = sent if kind == "sparse" else sent.dense()
            norms[kind] = memory.update(handle, call, p, Sent(sent, None, (), 4), None)
            memory.close(0, 0, handle)
        dense_memory, sparse_memory = memories["dense"], memories["sparse"]
        for kind, name in enumerate(("u", "v")):  # the rows open() hands out: u, v
            want, got = (m.open(0, 0)[kind] for m in (dense_memory, sparse_memory))
            assert torch.equal(want, got), name
            assert torch.equal(torch.signbit(want), torch.signbit(got)), name
        assert dense_memory.open(0, 0)[0][10] != 0  # the zero value left u there
        assert norms["sparse"] == norms["dense"]


def capture_plan_of(d: int):
    from gradstat.compressors.plan import build_plan

    return build_plan(layer_table([("w", (d,))]))


def test_ram_rows_start_at_zero_and_keep_what_is_saved():
    """Rows are zeroed by a thread of their own: every row must read as zeros (the
    memory is ``torch.empty``, so without the zeroing a reused block would show
    through), and a row saved is that row from then on."""
    garbage = torch.full((4, 1024), 7.0)  # freed, so the allocator may hand it out again
    del garbage
    rows = RamRows(4, 1024)
    try:
        for row in range(4):
            assert torch.count_nonzero(rows.load(row)) == 0
        rows.save(2, torch.arange(1024, dtype=torch.float32))
        assert torch.equal(rows.load(2), torch.arange(1024, dtype=torch.float32))
        assert torch.count_nonzero(rows.load(3)) == 0
    finally:
        rows.close()


@pytest.mark.parametrize("density", [0.001, 0.3, 1.0])
def test_sparse_estimates_error_and_cosine_equal_the_dense_rows(density):
    """A sparsifier's aggregate kept at its indices gives the relative error and cosine
    of its dense row (float64 sums over every value), also where its indices cover the
    whole row and the estimate is the reference itself (error 0, cosine 1)."""
    rng = np.random.default_rng(7)
    d = 50_000
    reference = torch.from_numpy(rng.laplace(size=d).astype(np.float32))
    indices = torch.from_numpy(rng.permutation(d)[: int(density * d)])
    values = reference[indices] + torch.from_numpy(rng.normal(size=indices.numel()) * 0.1).float()
    sparse = SparseRow(d, indices, values)
    e, r = sparse.dense().double().numpy(), reference.double().numpy()
    expected_rel = float(((e - r) ** 2).sum() / (r**2).sum())
    expected_cos = float(e @ r / np.sqrt((e @ e) * (r @ r)))
    rel, cos = ratios(error_sums(sparse, reference))
    assert rel == pytest.approx(expected_rel, rel=1e-9)
    assert cos == pytest.approx(expected_cos, rel=1e-12)
    assert ratios(error_sums(sparse.dense(), reference)) == pytest.approx((rel, cos), rel=1e-9)
    exact = SparseRow(d, torch.arange(d), reference.clone())
    rel, cos = ratios(error_sums(exact, reference))
    # ||r||^2 - sum_U r_i^2: two float64 sums of the same 50,000 terms in different
    # orders (a compiled loop, a BLAS dot), which differ by a few units of 1e-15 of it
    assert 0.0 <= rel < 1e-13 and cos == pytest.approx(1.0, abs=1e-12)
