"""Compressors and error-feedback memories against brute-force references on small vectors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gradstat.analysis.replay_block import replay_rows
from gradstat.compressors import (
    REGISTRY,
    DGCMemory,
    ResidualMemory,
    build_plan,
    build_scheme,
    parse_compressors,
)
from gradstat.compressors.base import pack_bits, unpack_bits
from gradstat.compressors.cast import FormatCompressor
from gradstat.compressors.exchange import Call, Sent, nbytes
from gradstat.compressors.memory import TensorRows
from gradstat.compressors.qsgd import QSGD
from gradstat.compressors.signsgd import EFSignSGD
from gradstat.compressors.terngrad import TernGrad
from gradstat.compressors.topk import TopK
from gradstat.errors import UsageError
from gradstat.stats.thresholds import estimate_threshold
from gradstat.store import layer_table
from gradstat.wire.formats import FORMATS


def laplace(shape, seed=0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.laplace(size=shape).astype(np.float32))


def brute_topk(x: np.ndarray, k: int) -> set[int]:
    return set(np.argsort(-np.abs(x), kind="stable")[:k].tolist())


def plan_of(d: int, shapes=(), granularity: str = "model"):
    """The plan of parameters ``shapes`` (one vector of ``d`` values by default)."""
    shapes = shapes or [(d,)]
    return build_plan(layer_table([(f"p{i}", s) for i, s in enumerate(shapes)]), granularity)


def scheme(name: str, ratio: float | None, d: int, shapes=(), seed: int = 0, granularity="model"):
    (spec,) = parse_compressors(name)
    return build_scheme(spec, ratio, plan_of(d, shapes, granularity), seed=seed)


def memory_rows(s, n: int, d: int) -> torch.Tensor:
    """The residual memory rows of scheme ``s`` (zeros before its first step; one block)."""
    if not isinstance(s.memory, ResidualMemory) or not hasattr(s, "rows_replayed"):
        return torch.zeros(n, d)
    return torch.stack([s.memory.open(i, 0)[0].clone() for i in range(n)])


def step(s, g: torch.Tensor):
    """One step of scheme ``s``: the outcome, its estimate and what each learner sent."""
    out = replay_rows(s, g)
    return out, out.estimate, out.sent


def payload_bytes(tensors) -> int:
    return sum(nbytes(t) for t in tensors)


# --- sparsifiers -----------------------------------------------------------------------


def test_topk_matches_argsort_and_counts_bytes():
    x = laplace((3, 200))
    compressor = TopK(k=7)
    for row in x:
        tensors, ctx = compressor.compress(row, "model")
        indices, values = tensors
        assert indices.dtype == torch.int32 and values.dtype == torch.float32
        assert set(indices.tolist()) == brute_topk(row.numpy(), 7)
        decoded = compressor.decompress(tensors, ctx).numpy()
        expected = np.where(np.isin(np.arange(200), indices.numpy()), row.numpy(), 0)
        np.testing.assert_array_equal(decoded, expected)
        assert payload_bytes(tensors) == 7 * (4 + 4)
    exchange, estimate, sent = step(scheme("topk", 7 / 200, 200), x)
    union = set().union(*(brute_topk(row.numpy(), 7) for row in x))
    assert exchange.union == len(union)
    assert [(t.collective, t.nbytes) for t in exchange.transfers] == [("allgather", 56)]
    np.testing.assert_allclose(estimate.numpy(), sent.mean(0).numpy(), rtol=1e-6)


def test_randomk_shares_indices_and_sends_values_only():
    x = laplace((4, 100))
    exchange, estimate, sent = step(scheme("randomk", 0.1, 100, seed=3), x)
    supports = [set(torch.nonzero(row).view(-1).tolist()) for row in sent]
    assert all(s == supports[0] for s in supports) and len(supports[0]) == 10
    idx = sorted(supports[0])
    np.testing.assert_allclose(estimate[idx].numpy(), x[:, idx].mean(0).numpy(), rtol=1e-6)
    assert [(t.collective, t.nbytes) for t in exchange.transfers] == [("allreduce", 40)]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_cltk_has_exactly_k_nonzeros_whatever_n(n):
    x = laplace((n, 300), seed=n)
    s = scheme("clt-k", 9 / 300, 300)
    for t in range(2 * n):
        memory = memory_rows(s, n, 300)
        exchange, estimate, _ = step(s, x)
        p = x + memory
        leader = t % n
        assert int(torch.count_nonzero(estimate)) == 9
        assert set(torch.nonzero(estimate).view(-1).tolist()) == brute_topk(p[leader].numpy(), 9)
        idx = torch.nonzero(estimate).view(-1)
        np.testing.assert_allclose(estimate[idx].numpy(), p[:, idx].mean(0).numpy(), atol=1e-6)
        assert exchange.union == 9
        assert [(t.collective, t.nbytes) for t in exchange.transfers] == [
            ("broadcast", 36),
            ("allreduce", 36),
        ]


def brute_gtopk(x: np.ndarray, k: int) -> np.ndarray:
    """Dense tree merge: leaves are local top-k vectors; each merge keeps top-k of the sum."""

    def keep_top(v):
        out = np.zeros_like(v)
        idx = list(brute_topk(v, k)) if np.count_nonzero(v) > k else np.nonzero(v)[0]
        out[idx] = v[idx]
        return out

    nodes = [keep_top(row) for row in x]
    while len(nodes) > 1:
        merged = [keep_top(nodes[j] + nodes[j + 1]) for j in range(0, len(nodes) - 1, 2)]
        nodes = merged + ([nodes[-1]] if len(nodes) % 2 else [])
    return nodes[0]


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_gtopk_matches_dense_tree_merge(n):
    x = laplace((n, 150), seed=10 + n)
    exchange, estimate, sent = step(scheme("gtopk", 8 / 150, 150), x)
    root = brute_gtopk(x.double().numpy(), 8)
    assert set(np.nonzero(estimate.numpy())[0]) <= set(np.nonzero(root)[0])
    assert exchange.union == np.count_nonzero(root) <= 8
    # each learner's surviving contribution is part of its own local top-k
    for row, learner_sent in zip(x.numpy(), sent.numpy(), strict=True):
        support = set(np.nonzero(learner_sent)[0].tolist())
        assert support <= brute_topk(row, 8)
        np.testing.assert_array_equal(learner_sent[list(support)], row[list(support)])


@pytest.mark.parametrize(
    "name",
    ["sidco-exp", "sidco-gpd", "sidco-gamma-gpd", "dgc", "gaussiank", "redsync", "redsync-sidco"],
)
def test_estimated_sparsifiers_select_what_their_threshold_selects(name):
    x = laplace((3, 5000), seed=4)
    spec = f"{name}:stages=2" if name.startswith("sidco") else name
    s = scheme(spec, 0.01, 5000)
    exchange = replay_rows(s, x)
    sent = exchange.sent  # DGC's memory: its v = g at the first step
    for row, learner_sent, selected in zip(x, sent, exchange.selected, strict=True):
        support = np.nonzero(learner_sent.numpy())[0]
        assert len(support) == selected > 0
        # every sent element is larger in magnitude than every element left out
        left = np.setdiff1d(np.arange(5000), support)
        assert np.abs(row.numpy()[support]).min() >= np.abs(row.numpy()[left]).max()
        np.testing.assert_array_equal(learner_sent.numpy()[support], row.numpy()[support])
    # Gaussian-k's 2 adjustments (x1.5, then x0.5) overshoot to q ~ 6.5 on these Laplace
    # rows, as the reference's loop does (tests/test_reference_behaviours.py)
    assert 0.25 < np.mean(exchange.selected) / 50 < (8 if name == "gaussiank" else 4)
    assert exchange.bytes_per_learner == pytest.approx(np.mean(exchange.selected) * 8)


def test_hard_threshold_is_calibrated_once_then_fixed():
    x = laplace((2, 1000), seed=5)
    s = scheme("threshold", 0.02, 1000)
    first = replay_rows(s, x)
    lam = sorted(np.abs(x[0].numpy()))[-20]
    assert s.compressor(0, 0).threshold == pytest.approx(lam)
    assert s.compressor(1, 0).threshold == s.compressor(0, 0).threshold  # broadcast
    assert first.selected[0] == 20
    assert first.selected[1] == int((np.abs(x[1].numpy()) >= lam).sum())
    m = memory_rows(s, 2, 1000)
    second = replay_rows(s, 2 * x)
    assert second.selected[0] == int((np.abs(2 * x[0].numpy() + m[0].numpy()) >= lam).sum()) > 20


# --- quantisers ------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_pack_bits_round_trip_and_size(bits):
    rng = np.random.default_rng(bits)
    codes = torch.from_numpy(rng.integers(0, 2**bits, size=101))
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(101 * bits / 8)
    np.testing.assert_array_equal(unpack_bits(packed, bits, 101).numpy(), codes.numpy())
    if bits == 1:
        np.testing.assert_array_equal(
            packed.numpy(), np.packbits(codes.numpy().astype(np.uint8), bitorder="little")
        )


@pytest.mark.parametrize(("dtype", "name"), [(torch.float16, "fp16"), (torch.bfloat16, "bf16")])
def test_casts(dtype, name):
    x = laplace((2, 50))
    compressor = FormatCompressor(FORMATS[name])
    assert compressor.name == name
    tensors, ctx = compressor.compress(x[0], "model")
    assert payload_bytes(tensors) == 100
    decoded = compressor.decompress(tensors, ctx).numpy()
    np.testing.assert_array_equal(decoded, x[0].to(dtype).float())


def test_ef_signsgd_and_majority_vote():
    x = laplace((3, 77), seed=6)
    ef = EFSignSGD()
    tensors, ctx = ef.compress(x[0], "model")
    assert payload_bytes(tensors) == math.ceil(77 / 8) + 4
    expected = np.abs(x[0].numpy()).mean() * np.where(x[0].numpy() >= 0, 1.0, -1.0)
    np.testing.assert_allclose(ef.decompress(tensors, ctx).numpy(), expected, rtol=1e-6)
    vote = replay_rows(scheme("signsgd", None, 77), x)
    signs = np.where(x.numpy() >= 0, 1.0, -1.0)
    scale = np.abs(x.numpy()).mean(axis=1).mean()
    np.testing.assert_allclose(vote.estimate.numpy(), np.sign(signs.sum(0)) * scale, rtol=1e-6)


def test_qsgd_matches_formula_with_the_same_noise():
    x = laplace((1000,), seed=7)
    compressor = QSGD(levels=15, bucket=256, seed=1)
    noise_gen = torch.Generator().set_state(compressor.generator.get_state())
    tensors, ctx = compressor.compress(x, "model")
    level, norms = tensors
    assert level.dtype == torch.int8 and payload_bytes(tensors) == 1000 + 4 * 4
    noise = torch.rand((4, 256), generator=noise_gen).numpy().reshape(-1)[:1000]
    v = x.numpy()
    padded = np.pad(v, (0, 24)).reshape(4, 256)
    np.testing.assert_allclose(norms.numpy(), np.linalg.norm(padded, axis=1), rtol=1e-6)
    bucket_norm = np.repeat(np.linalg.norm(padded, axis=1), 256)[:1000]
    expected_level = np.minimum(np.floor(np.abs(v) / bucket_norm * 15 + noise), 15) * np.sign(v)
    np.testing.assert_array_equal(level.numpy(), expected_level)
    np.testing.assert_allclose(
        compressor.decompress(tensors, ctx).numpy(), bucket_norm * expected_level / 15, rtol=1e-6
    )


def test_qsgd_and_terngrad_are_unbiased():
    x = laplace((400,), seed=8)
    for compressor in (QSGD(levels=3, bucket=64, seed=2), TernGrad(seed=2)):
        mean = torch.stack(
            [compressor.decompress(*compressor.compress(x, "model")) for _ in range(3000)]
        )
        error = (mean.mean(0) - x).abs().max()
        assert error < 0.15 * float(x.abs().max()), compressor.name


def test_terngrad_matches_formula_with_the_same_noise():
    x = laplace((99,), seed=9)
    compressor = TernGrad(seed=4)
    noise_gen = torch.Generator().set_state(compressor.generator.get_state())
    tensors, ctx = compressor.compress(x, "model")
    assert payload_bytes(tensors) == math.ceil(99 / 4) + 4
    v = x.numpy()
    s = np.abs(v).max()
    keep = torch.rand(99, generator=noise_gen).numpy() < np.abs(v) / s
    np.testing.assert_allclose(compressor.decompress(tensors, ctx).numpy(), s * np.sign(v) * keep)


# --- PowerSGD --------------------------------------------------------------------------


def test_powersgd_matches_numpy_power_iteration_with_warm_start():
    shapes = [(12, 2, 5), (7,), (3, 3)]  # a 12x10 matrix, a bias, a too-small 3x3 matrix
    s = scheme("powersgd:rank=2", None, 136, shapes=shapes, seed=5)
    assert [(rows, cols) for _, rows, cols in s.compressor(0, 0).matrices] == [(12, 10)]
    q = torch.randn(10, 2, generator=torch.Generator().manual_seed(5)).double().numpy()
    for t in range(3):
        x = laplace((3, 136), seed=20 + t)
        p_rows = (x + memory_rows(s, 3, 136)).double().numpy()
        exchange = replay_rows(s, x)
        m = p_rows[:, :120].reshape(3, 12, 10)
        p = np.mean(m @ q, axis=0)
        p_hat, _ = np.linalg.qr(p)
        q = np.mean(np.transpose(m, (0, 2, 1)) @ p_hat, axis=0)
        np.testing.assert_allclose(
            exchange.estimate[:120].numpy(), (p_hat @ q.T).reshape(-1), rtol=1e-4, atol=1e-5
        )
        np.testing.assert_allclose(
            exchange.estimate[120:].numpy(), p_rows[:, 120:].mean(0), rtol=1e-6, atol=1e-6
        )
        assert [t.nbytes for t in exchange.transfers] == [(16 + 2 * 12) * 4, 2 * 10 * 4]


def test_powersgd_recovers_a_shared_rank_one_matrix_exactly():
    rng = np.random.default_rng(1)
    m = np.outer(rng.normal(size=30), rng.normal(size=20)).astype(np.float32)
    x = torch.from_numpy(np.stack([m.reshape(-1)] * 2))
    exchange = replay_rows(scheme("powersgd:rank=1", None, 600, shapes=[(30, 20)]), x)
    np.testing.assert_allclose(exchange.estimate.numpy(), m.reshape(-1), rtol=1e-4, atol=1e-5)


def test_powersgd_keeps_no_residual_for_parameters_sent_uncompressed():
    # Regression: the bias (1-D) and the too-small 3x3 matrix go uncompressed; their
    # memory must stay zero (as PyTorch's powerSGD_hook), the 12x10 matrix keeps M - PQ^T.
    shapes = [(12, 2, 5), (7,), (3, 3)]
    s = scheme("powersgd:rank=2", None, 136, shapes=shapes)
    for t in range(3):
        x = laplace((3, 136), seed=40 + t)
        corrected = x + memory_rows(s, 3, 136)
        exchange = replay_rows(s, x)
        memory = memory_rows(s, 3, 136)
        assert torch.count_nonzero(memory[:, 120:]) == 0
        expected = corrected[:, :120] - exchange.estimate[:120]
        np.testing.assert_allclose(memory[:, :120].numpy(), expected.numpy(), atol=1e-6)
        assert torch.count_nonzero(memory[:, :120]) > 0


def test_powersgd_refuses_a_scope_without_matrices():
    (spec,) = parse_compressors("powersgd")
    with pytest.raises(UsageError, match="compresses no parameter"):
        build_scheme(spec, None, plan_of(10))


# --- error feedback --------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "topk",
        "randomk",
        "threshold",
        "sidco-exp",
        "gaussiank",
        "clt-k",
        "gtopk",
        "powersgd",
        "ef-signsgd",
    ],
)
def test_error_feedback_invariant(name):
    """With beta = 1: everything fed in = everything sent + the final memory (per learner)."""
    n, d = 3, 400
    s = scheme(name, None if REGISTRY[name].fixed_rate else 0.05, d, shapes=[(20, 20)])
    fed = torch.zeros(n, d, dtype=torch.float64)
    sent = torch.zeros(n, d, dtype=torch.float64)
    for t in range(6):
        g = laplace((n, d), seed=t)
        _, _, sent_now = step(s, g)
        fed += g.double()
        sent += sent_now.double()
    memory = memory_rows(s, n, d).double()
    np.testing.assert_allclose(fed.numpy(), (sent + memory).numpy(), rtol=1e-5, atol=1e-4)


def _memory(memory, d: int):
    memory.allocate(1, plan_of(d), TensorRows)
    return memory, Call("p0", 0, 0, 0, 1, shape=(d,))


def test_low_pass_memory_follows_scalecom():
    memory, call = _memory(ResidualMemory(beta=0.3), 5)
    m = np.zeros(5)
    for t in range(4):
        g = laplace((5,), seed=t)
        rows = memory.open(0, 0)
        p = memory.compensate(rows, call, g)
        c = torch.where(p.abs() > 0.5, p, torch.zeros_like(p))
        squares = memory.update(rows, call, p, Sent(c, c, (), 5), None)
        m = 0.7 * m + 0.3 * (m + g.numpy() - c.numpy())
        np.testing.assert_allclose(memory.open(0, 0)[0].numpy(), m, rtol=1e-6, atol=1e-7)
        assert squares == pytest.approx(np.linalg.norm(m) ** 2, rel=1e-6)


def test_dgc_memory_momentum_correction_and_factor_masking():
    memory, call = _memory(DGCMemory(momentum=0.9), 6)
    u = np.zeros(6)
    v = np.zeros(6)
    for t in range(5):
        g = laplace((6,), seed=t).numpy()
        u = 0.9 * u + g
        v = v + u
        rows = memory.open(0, 0)
        p = memory.compensate(rows, call, torch.from_numpy(g).float())
        np.testing.assert_allclose(p.numpy(), v, rtol=1e-5)
        top = np.argsort(-np.abs(v))[:2]
        c = np.zeros(6, dtype=np.float32)
        c[top] = v[top]
        sent = torch.from_numpy(c)
        memory.update(rows, call, p, Sent(sent, sent, (), 2), None)
        v[top] = 0.0
        u[top] = 0.0
        np.testing.assert_allclose(memory.open(0, 0)[1].numpy(), v, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(memory.open(0, 0)[0].numpy(), u, rtol=1e-5, atol=1e-6)


def test_dgc_reference_is_the_dense_momentum_update():
    s = scheme("dgc:momentum=0.5", 0.1, 100)
    g = laplace((100,))
    np.testing.assert_allclose(s.reference(0, g).numpy(), g.numpy())
    np.testing.assert_allclose(s.reference(0, g).numpy(), 1.5 * g.numpy(), rtol=1e-6)


# --- registry --------------------------------------------------------------------------


def test_every_registered_compressor_runs_and_reports_exact_bytes():
    d = 400
    for name, entry in REGISTRY.items():
        s = scheme(name, None if entry.fixed_rate else 0.05, d, shapes=[(20, 20)])
        exchange = replay_rows(s, laplace((2, d)))
        assert exchange.estimate.shape == (d,)
        assert exchange.bytes_per_learner > 0, name
    expected = {
        "none": 1600,
        "fp16": 800,
        "topk": 160,
        "randomk": 80,
        "clt-k": 160,
        "gtopk": 320,
        "signsgd": 54,
        "qsgd": 400 + 4,
        "terngrad": 104,
        "powersgd": 2 * (20 + 20) * 4,
    }
    for name, want in expected.items():
        s = scheme(name, None if REGISTRY[name].fixed_rate else 0.05, d, shapes=[(20, 20)])
        if name == "powersgd":
            s = scheme("powersgd:rank=2", None, d, shapes=[(20, 20)])
        assert replay_rows(s, laplace((2, d))).bytes_per_learner == want, name


def test_parse_compressors_and_bad_names():
    specs = parse_compressors("topk,clt-k:beta=0.1,powersgd", {"rank": 2})
    assert [s.label for s in specs] == ["topk", "clt-k:beta=0.1", "powersgd:rank=2"]
    assert dict(specs[1].params) == {"beta": 0.1}
    for bad, match in [
        ("topk,nope", "unknown compressor 'nope'"),
        ("clt-k:gamma=1", "no parameter 'gamma'"),
        ("clt-k:beta=x", "must be a number"),
        ("topk,topk", "named twice"),
        ("", "at least one"),
    ]:
        with pytest.raises(UsageError, match=match):
            parse_compressors(bad)
    with pytest.raises(UsageError, match=r"beta must be in \(0, 1\]"):
        scheme("clt-k:beta=0", 0.1, 100)


def test_memory_and_collective_are_named_in_the_spec():
    specs = parse_compressors(
        "terngrad+residual,clt-k:beta=0.5+none,none:collective=allgather,"
        "dgc+residual:beta=0.5,threshold:threshold=1e+3"
    )
    assert [s.label for s in specs] == [
        "terngrad+residual",
        "clt-k:beta=0.5+none",
        "none:collective=allgather",
        "dgc+residual:beta=0.5",
        "threshold:threshold=1000",
    ]
    memories = [type(scheme(s.label, 0.05, 400).memory).__name__ for s in specs]
    assert memories == [
        "ResidualMemory",
        "NoMemory",
        "NoMemory",
        "ResidualMemory",
        "ResidualMemory",
    ]
    assert scheme("dgc", 0.05, 400).memory.momentum == 0.9
    assert scheme("none:collective=allgather", None, 400).compressor(0, 0).collective == "allgather"
    for bad, match in [
        ("topk+zip", "unknown memory 'zip'"),
        ("topk+residual:gamma=1", "memory residual has no parameter 'gamma'"),
        ("topk+none+none", r"COMPRESSOR\+MEMORY"),
        ("topk:collective=allreduce", "payloads do not add up"),
        ("clt-k:collective=allgather", "exchange is its own"),
        ("none:collective=ring", "allgather or allreduce"),
    ]:
        with pytest.raises(UsageError, match=match):
            parse_compressors(bad)


def test_sidco_compressors_take_the_reference_choices():
    (spec,) = parse_compressors("sidco-gpd:stages=3:stage_fit=mle:zeros=include")
    assert spec.label == "sidco-gpd:stages=3:zeros=include:stage_fit=mle"
    x = laplace((2, 20_000), seed=9)
    x[:, ::10] = 0.0
    built = scheme(spec.label, 0.01, 20_000)
    compressor = built.compressor(0, 0)
    assert (compressor.zeros, compressor.stage_fit) == ("include", "mle")
    exchange = replay_rows(built, x)
    for row, selected in zip(x, exchange.selected, strict=True):
        expected = estimate_threshold(
            row, 0.01, "sidco-gpd", stages=3, zeros="include", stage_fit="mle"
        )
        assert selected == expected.selected
    default = scheme("sidco-gpd:stages=3", 0.01, 20_000).compressor(0, 0)
    assert (default.zeros, default.stage_fit) == ("exclude", "moments")
    with pytest.raises(UsageError, match="zeros must be one of exclude, include"):
        parse_compressors("sidco-exp:zeros=all")


def test_a_density_applies_to_each_message_by_the_compressors_rule():
    """No skipped combinations: every message keeps at least one element, the built-ins
    ``max(1, round(ratio * numel))``, a user's class GRACE's ``max(1, int(...))``."""
    s = scheme(
        "topk", 0.001, 590, shapes=[(8, 1, 3, 3), (8,), (10, 50), (10,)], granularity="tensor"
    )
    assert [s.k(m) for m in range(4)] == [1, 1, 1, 1]
    out = replay_rows(s, laplace((2, 590)))
    assert out.selected == [4, 4]
    (spec,) = parse_compressors("topk")
    with pytest.raises(UsageError, match="give it a ratio"):
        build_scheme(spec, None, plan_of(500))
    with pytest.raises(UsageError, match="outside"):
        build_scheme(spec, 1.5, plan_of(500))
