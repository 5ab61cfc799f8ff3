"""The streamed replay step against ``Scheme.step`` on whole steps, and its scratch file."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from gradstat.analysis.ef_store import SCRATCH_ENV, MemoryRows, RamRows
from gradstat.analysis.replay import scope_shapes
from gradstat.analysis.replay_stream import SparseRow, replay_streamed
from gradstat.analysis.selection import k_for
from gradstat.compressors import REGISTRY, build_scheme, parse_compressors
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


def _scheme(cap, name):
    (spec,) = parse_compressors(name)
    scope = cap.scopes("model")[0]
    ratio = None if spec.fixed_rate else 0.05
    k = None if ratio is None else k_for(ratio, scope.numel)
    shapes = scope_shapes(cap.layers, scope)
    return scope, build_scheme(spec, ratio, k, numel=scope.numel, shapes=shapes, seed=0)


def _reference(cap, name):
    """The plain whole-step reference (tests/reference_compressors.py) of ``name``."""
    (spec,) = parse_compressors(name)
    scope, scheme = _scheme(cap, name)
    shapes = scope_shapes(cap.layers, scope)
    return Reference(
        spec.name, spec.params, scheme.ratio, scheme.compressor.k, scope.numel, shapes, 0, LEARNERS
    )


def _dense(estimate):
    return estimate.dense() if isinstance(estimate, SparseRow) else estimate


@pytest.mark.parametrize("name", NAMES)
def test_streamed_step_equals_whole_step_reference(capture, name):
    """Row by row, every compressor gives the aggregate, memory norm, union, selections
    and bytes of the plain whole-step reference on the stacked step, bit for bit, in RAM
    and on scratch."""
    with open_capture(capture) as cap:
        whole = _reference(cap, name)
        streams = {
            scratch: replay_streamed(
                cap, list(cap.steps), cap.learners, [_scheme(cap, name)], scratch=scratch
            )
            for scratch in (False, True)
        }
        for step in cap.steps:
            exchange = whole.step(cap.read_step(int(step)))
            reference = whole.reference(cap.read_step(int(step)).mean(dim=0))
            for scratch, stream in streams.items():
                got_step, [result] = next(stream)
                outcome = result.outcome
                assert got_step == step
                assert torch.equal(_dense(outcome.estimate), exchange.estimate), (name, scratch)
                assert torch.allclose(result.reference, reference, rtol=1e-6, atol=1e-7)
                assert outcome.memory_norm == pytest.approx(exchange.memory_norm, rel=1e-12)
                assert outcome.union == exchange.union
                assert outcome.selected == exchange.selected
                got = [(t.collective, t.nbytes) for t in outcome.transfers]
                assert got == [(c, pytest.approx(b)) for c, b in exchange.transfers], name
                assert outcome.info == pytest.approx(exchange.info)


def test_streamed_topk_of_long_rows_equals_whole_step(tmp_path):
    """Rows long enough for top-k's one-pass path (sampled threshold, candidates, and the
    memory's norm from the squares below the threshold and of the candidates not sent):
    the same aggregate and selections as the whole-step reference, the same norm to
    float64."""
    rng = np.random.default_rng(5)
    layers = layer_table([("w", (70_001,))])
    grads = rng.laplace(size=(3, 3, 70_001)).astype(np.float32)
    path = write_capture(tmp_path / "cap", grads, layers)
    with open_capture(path) as cap:
        (spec,) = parse_compressors("topk")
        scope = cap.scopes("model")[0]
        k = k_for(0.01, scope.numel)
        whole = Reference("topk", {}, 0.01, k, scope.numel, [(70_001,)], 0, 3)
        scheme = build_scheme(spec, 0.01, k, numel=scope.numel)
        stream = replay_streamed(cap, list(cap.steps), cap.learners, [(scope, scheme)])
        for step in cap.steps:
            exchange = whole.step(cap.read_step(int(step)))
            _, [result] = next(stream)
            assert torch.equal(_dense(result.outcome.estimate), exchange.estimate)
            assert result.outcome.selected == exchange.selected
            assert result.outcome.memory_norm == pytest.approx(exchange.memory_norm, rel=1e-12)
            assert result.outcome.memory_norm > 0
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
    """DGC's memories after a sparse payload (``mask_sent``) equal ``update`` with the
    dense ``sent``, also where a sent value is 0 (``u`` is not zeroed there) or -0.0."""
    rng = np.random.default_rng(5)
    g = torch.from_numpy(rng.standard_normal((2, 64)).astype(np.float32))
    index = torch.tensor([3, 10, 17, 40])
    with MemoryRows(scratch) as rows:
        dense, sparse = DGCMemory(0.5), DGCMemory(0.5)
        for memories in (dense, sparse):
            memories.allocate(1, 64, rows.new)
        for memories in (dense, sparse):  # a first step fills u and v
            p, state = memories.compensate(0, g[0])
            memories.update(0, p, torch.zeros(64), state)
        p, state = dense.compensate(0, g[1])
        values = p[index].clone()
        values[1], values[2] = 0.0, -0.0  # sent as zeros: not masked
        sent = torch.zeros(64).index_put_((index,), values)
        dense.update(0, p, sent, state)
        p, state = sparse.compensate(0, g[1])
        sparse.mask_sent(0, index[values != 0], state, values)
        for name in ("u", "v"):
            want, got = getattr(dense, name).load(0), getattr(sparse, name).load(0)
            assert torch.equal(want, got), name
            assert torch.equal(torch.signbit(want), torch.signbit(got)), name
        assert dense.u.load(0)[10] != 0  # the zero value left u there
        # the sparse norm is ||v||^2 (found while forming v) less the squares sent: the
        # norm of the masked v to float64 rounding (the mean over both steps' norms)
        assert sparse.norm() == pytest.approx(dense.norm(), rel=1e-14)


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


def test_ram_rows_hand_a_zeroing_failure_to_the_caller(monkeypatch):
    """A failure in the zeroing thread is raised by ``load``, not a wait forever."""

    def fail(self):
        raise MemoryError("no pages")

    monkeypatch.setattr(torch.Tensor, "zero_", fail)
    rows = RamRows(2, 16)
    with pytest.raises(MemoryError, match="no pages"):
        rows.load(1)
    rows.close()


def test_ram_rows_close_stops_the_zeroing(monkeypatch):
    """Closing a store (a replay that fails at its first step) does not zero every row
    first, and a load after it is an error, not a wait for a row nobody zeroes."""
    zeroed = []
    zero = torch.Tensor.zero_

    def counted(self):
        zeroed.append(self.numel())
        return zero(self)

    monkeypatch.setattr(torch.Tensor, "zero_", counted)
    rows = RamRows(256, 1 << 20)
    rows.close()
    assert not rows._zeroing.is_alive()
    assert len(zeroed) < 256
    with pytest.raises(RuntimeError, match="closed"):
        rows.load(255)


@pytest.mark.parametrize("density", [0.001, 0.3, 1.0])
def test_sparse_estimates_error_and_cosine_equal_the_dense_rows(density):
    """A sparsifier's aggregate kept at its indices gives the relative error and cosine
    of its dense row (float64 sums over every value), also where its indices cover the
    whole row and the estimate is the reference itself (error 0, cosine 1)."""
    from gradstat.analysis.replay import error_and_cosine

    rng = np.random.default_rng(7)
    d = 50_000
    reference = torch.from_numpy(rng.laplace(size=d).astype(np.float32))
    indices = torch.from_numpy(rng.permutation(d)[: int(density * d)])
    values = reference[indices] + torch.from_numpy(rng.normal(size=indices.numel()) * 0.1).float()
    sparse = SparseRow(d, indices, values)
    dense = sparse.dense()
    e, r = dense.double().numpy(), reference.double().numpy()
    expected_rel = float(((e - r) ** 2).sum() / (r**2).sum())
    expected_cos = float(e @ r / np.sqrt((e @ e) * (r @ r)))
    rel, cos = error_and_cosine(sparse, reference)
    assert rel == pytest.approx(expected_rel, rel=1e-9)
    assert cos == pytest.approx(expected_cos, rel=1e-12)
    assert error_and_cosine(dense, reference) == pytest.approx((rel, cos), rel=1e-9)
    exact = SparseRow(d, torch.arange(d), reference.clone())
    rel, cos = error_and_cosine(exact, reference)
    # ||r||^2 - sum_U r_i^2: two float64 sums of the same 50,000 terms in different
    # orders (a compiled loop, a BLAS dot), which differ by a few units of 1e-15 of it
    assert 0.0 <= rel < 1e-13 and cos == pytest.approx(1.0, abs=1e-12)
