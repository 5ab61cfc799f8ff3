"""Compressors and error-feedback memories against brute-force references on small vectors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gradstat.compressors import (
    REGISTRY,
    DGCMemory,
    ResidualMemory,
    build_scheme,
    parse_compressors,
)
from gradstat.compressors.estimated import EstimatedSparsifier
from gradstat.compressors.legacy import pack_bits, unpack_bits
from gradstat.compressors.powersgd import PowerSGD
from gradstat.compressors.quantize import QSGD, Cast, SignSGD, TernGrad
from gradstat.compressors.sparse import CLTK, GTopK, RandomK, TopK
from gradstat.errors import UsageError
from gradstat.stats.thresholds import estimate_threshold


def laplace(shape, seed=0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.laplace(size=shape).astype(np.float32))


def brute_topk(x: np.ndarray, k: int) -> set[int]:
    return set(np.argsort(-np.abs(x), kind="stable")[:k].tolist())


def scheme(name: str, ratio: float | None, d: int, shapes=(), seed: int = 0):
    (spec,) = parse_compressors(name)
    k = None if spec.fixed_rate else max(1, round(ratio * d))
    return build_scheme(spec, ratio, k, numel=d, shapes=shapes or [(d,)], seed=seed)


# --- sparsifiers -----------------------------------------------------------------------


def test_topk_matches_argsort_and_counts_bytes():
    x = laplace((3, 200))
    compressor = TopK(k=7)
    for row in x:
        payload = compressor.compress(row)
        indices, values = payload.tensors
        assert indices.dtype == torch.int32 and values.dtype == torch.float32
        assert set(indices.tolist()) == brute_topk(row.numpy(), 7)
        dense = compressor.decompress(payload).numpy()
        expected = np.where(np.isin(np.arange(200), indices.numpy()), row.numpy(), 0)
        np.testing.assert_array_equal(dense, expected)
        assert payload.nbytes == 7 * (4 + 4)
    exchange = compressor.exchange(x)
    union = set().union(*(brute_topk(row.numpy(), 7) for row in x))
    assert exchange.union == len(union)
    assert exchange.gathered_bytes == 3 * 56
    np.testing.assert_allclose(exchange.estimate.numpy(), exchange.sent.mean(0).numpy())


def test_randomk_shares_indices_and_sends_values_only():
    x = laplace((4, 100))
    exchange = RandomK(k=10, seed=3).exchange(x)
    supports = [set(torch.nonzero(row).view(-1).tolist()) for row in exchange.sent]
    assert all(s == supports[0] for s in supports) and len(supports[0]) == 10
    idx = sorted(supports[0])
    np.testing.assert_allclose(exchange.estimate[idx].numpy(), x[:, idx].mean(0).numpy())
    assert [(t.collective, t.nbytes) for t in exchange.transfers] == [("allreduce", 40)]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_cltk_has_exactly_k_nonzeros_whatever_n(n):
    x = laplace((n, 300), seed=n)
    compressor = CLTK(k=9)
    for step in range(2 * n):
        exchange = compressor.exchange(x)
        leader = step % n
        assert int(torch.count_nonzero(exchange.estimate)) == 9
        assert set(torch.nonzero(exchange.estimate).view(-1).tolist()) == brute_topk(
            x[leader].numpy(), 9
        )
        idx = torch.nonzero(exchange.estimate).view(-1)
        np.testing.assert_allclose(exchange.estimate[idx].numpy(), x[:, idx].mean(0).numpy())
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
    x = laplace((n, 150), seed=10 + n).double()
    exchange = GTopK(k=8).exchange(x)
    root = brute_gtopk(x.numpy(), 8)
    np.testing.assert_allclose(exchange.estimate.numpy() * n, root, rtol=1e-12, atol=1e-12)
    assert exchange.union == np.count_nonzero(root) <= 8
    # each learner's surviving contribution is part of its own local top-k
    for row, sent in zip(x.numpy(), exchange.sent.numpy(), strict=True):
        support = set(np.nonzero(sent)[0].tolist())
        assert support <= brute_topk(row, 8)
        np.testing.assert_array_equal(sent[list(support)], row[list(support)])


@pytest.mark.parametrize(
    "name",
    ["sidco-exp", "sidco-gpd", "sidco-gamma-gpd", "dgc", "gaussiank", "redsync", "redsync-sidco"],
)
def test_estimated_sparsifiers_select_what_their_threshold_selects(name):
    x = laplace((3, 5000), seed=4)
    compressor = EstimatedSparsifier(name, 0.01, 50, 5000, name, stages=2)
    exchange = compressor.exchange(x)
    for row, sent, selected in zip(x, exchange.sent, exchange.selected, strict=True):
        support = np.nonzero(sent.numpy())[0]
        assert len(support) == selected > 0
        # every sent element is larger in magnitude than every element left out
        left = np.setdiff1d(np.arange(5000), support)
        assert np.abs(row.numpy()[support]).min() >= np.abs(row.numpy()[left]).max()
        np.testing.assert_array_equal(sent.numpy()[support], row.numpy()[support])
    # Gaussian-k's 2 adjustments (x1.5, then x0.5) overshoot to q ~ 6.5 on these Laplace
    # rows, as the reference's loop does (tests/test_reference_behaviours.py)
    assert 0.25 < np.mean(exchange.selected) / 50 < (8 if name == "gaussiank" else 4)
    assert exchange.bytes_per_learner == pytest.approx(np.mean(exchange.selected) * 8)


def test_hard_threshold_is_calibrated_once_then_fixed():
    x = laplace((2, 1000), seed=5)
    compressor = EstimatedSparsifier("threshold", 0.02, 20, 1000, "hard")
    first = compressor.exchange(x)
    lam = sorted(np.abs(x[0].numpy()))[-20]
    assert compressor.threshold == pytest.approx(lam)
    assert first.selected[0] == 20
    assert first.selected[1] == int((np.abs(x[1].numpy()) >= lam).sum())
    second = compressor.exchange(2 * x)
    assert second.selected[0] == int((np.abs(2 * x[0].numpy()) >= lam).sum()) > 20


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
    compressor = Cast(dtype)
    assert compressor.name == name
    payload = compressor.compress(x[0])
    assert payload.nbytes == 100
    np.testing.assert_array_equal(compressor.decompress(payload).numpy(), x[0].to(dtype).float())


def test_ef_signsgd_and_majority_vote():
    x = laplace((3, 77), seed=6)
    ef = SignSGD(majority=False)
    payload = ef.compress(x[0])
    assert payload.nbytes == math.ceil(77 / 8) + 4
    expected = np.abs(x[0].numpy()).mean() * np.where(x[0].numpy() >= 0, 1.0, -1.0)
    np.testing.assert_allclose(ef.decompress(payload).numpy(), expected, rtol=1e-6)
    vote = SignSGD(majority=True).exchange(x)
    signs = np.where(x.numpy() >= 0, 1.0, -1.0)
    scale = np.abs(x.numpy()).mean(axis=1).mean()
    np.testing.assert_allclose(vote.estimate.numpy(), np.sign(signs.sum(0)) * scale, rtol=1e-6)


def test_qsgd_matches_formula_with_the_same_noise():
    x = laplace((1000,), seed=7)
    compressor = QSGD(levels=15, bucket=256, seed=1)
    noise_gen = torch.Generator().set_state(compressor.generator.get_state())
    payload = compressor.compress(x)
    level, norms = payload.tensors
    assert level.dtype == torch.int8 and payload.nbytes == 1000 + 4 * 4
    noise = torch.rand((4, 256), generator=noise_gen).numpy().reshape(-1)[:1000]
    v = x.numpy()
    padded = np.pad(v, (0, 24)).reshape(4, 256)
    np.testing.assert_allclose(norms.numpy(), np.linalg.norm(padded, axis=1), rtol=1e-6)
    bucket_norm = np.repeat(np.linalg.norm(padded, axis=1), 256)[:1000]
    expected_level = np.minimum(np.floor(np.abs(v) / bucket_norm * 15 + noise), 15) * np.sign(v)
    np.testing.assert_array_equal(level.numpy(), expected_level)
    np.testing.assert_allclose(
        compressor.decompress(payload).numpy(), bucket_norm * expected_level / 15, rtol=1e-6
    )


def test_qsgd_and_terngrad_are_unbiased():
    x = laplace((400,), seed=8)
    for compressor in (QSGD(levels=3, bucket=64, seed=2), TernGrad(seed=2)):
        mean = torch.stack([compressor.decompress(compressor.compress(x)) for _ in range(3000)])
        error = (mean.mean(0) - x).abs().max()
        assert error < 0.15 * float(x.abs().max()), compressor.name


def test_terngrad_matches_formula_with_the_same_noise():
    x = laplace((99,), seed=9)
    compressor = TernGrad(seed=4)
    noise_gen = torch.Generator().set_state(compressor.generator.get_state())
    payload = compressor.compress(x)
    assert payload.nbytes == math.ceil(99 / 4) + 4
    v = x.numpy()
    s = np.abs(v).max()
    keep = torch.rand(99, generator=noise_gen).numpy() < np.abs(v) / s
    np.testing.assert_allclose(compressor.decompress(payload).numpy(), s * np.sign(v) * keep)


# --- PowerSGD --------------------------------------------------------------------------


def test_powersgd_matches_numpy_power_iteration_with_warm_start():
    shapes = [(12, 2, 5), (7,), (3, 3)]  # a 12x10 matrix, a bias, a too-small 3x3 matrix
    compressor = PowerSGD(shapes, rank=2, seed=5)
    assert [(rows, cols) for _, rows, cols in compressor.matrices] == [(12, 10)]
    q = torch.randn(10, 2, generator=torch.Generator().manual_seed(5)).double().numpy()
    for step in range(3):
        x = laplace((3, 136), seed=20 + step).double()
        exchange = compressor.exchange(x)
        m = x[:, :120].numpy().reshape(3, 12, 10)
        p = np.mean(m @ q, axis=0)
        p_hat, _ = np.linalg.qr(p)
        q = np.mean(np.transpose(m, (0, 2, 1)) @ p_hat, axis=0)
        np.testing.assert_allclose(
            exchange.estimate[:120].numpy(), (p_hat @ q.T).reshape(-1), rtol=1e-9, atol=1e-12
        )
        np.testing.assert_allclose(exchange.estimate[120:].numpy(), x[:, 120:].mean(0).numpy())
        size = 8  # float64
        assert [t.nbytes for t in exchange.transfers] == [(16 + 2 * 12) * size, 2 * 10 * size]


def test_powersgd_recovers_a_shared_rank_one_matrix_exactly():
    rng = np.random.default_rng(1)
    m = np.outer(rng.normal(size=30), rng.normal(size=20))
    x = torch.from_numpy(np.stack([m.reshape(-1)] * 2))
    exchange = PowerSGD([(30, 20)], rank=1).exchange(x)
    np.testing.assert_allclose(exchange.estimate.numpy(), m.reshape(-1), atol=1e-10)


def test_powersgd_keeps_no_residual_for_parameters_sent_uncompressed():
    # Regression: the bias (1-D) and the too-small 3x3 matrix go uncompressed; their
    # memory must stay zero (as PyTorch's powerSGD_hook), the 12x10 matrix keeps M - PQ^T.
    shapes = [(12, 2, 5), (7,), (3, 3)]
    s = scheme("powersgd:rank=2", None, 136, shapes=shapes)
    for step in range(3):
        x = laplace((3, 136), seed=40 + step)
        corrected = s.memory.compensate(x)
        exchange = s.step(x)
        memory = s.memory.memory
        assert torch.count_nonzero(memory[:, 120:]) == 0
        expected = corrected[:, :120] - exchange.estimate[:120]
        np.testing.assert_allclose(memory[:, :120].numpy(), expected.numpy(), atol=1e-6)
        assert torch.count_nonzero(memory[:, :120]) > 0


def test_powersgd_refuses_a_scope_without_matrices():
    (spec,) = parse_compressors("powersgd")
    with pytest.raises(UsageError, match="compresses no parameter"):
        build_scheme(spec, None, None, numel=10, shapes=[(10,)])


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
    for step in range(6):
        g = laplace((n, d), seed=step)
        exchange = s.step(g)
        fed += g.double()
        sent += exchange.sent.double()
    np.testing.assert_allclose(
        fed.numpy(), (sent + s.memory.memory.double()).numpy(), rtol=1e-5, atol=1e-4
    )


def test_low_pass_memory_follows_scalecom():
    memory = ResidualMemory(beta=0.3)
    m = np.zeros(5)
    for step in range(4):
        g = laplace((5,), seed=step)
        p = memory.compensate(g)
        c = torch.where(p.abs() > 0.5, p, torch.zeros_like(p))
        memory.update(p, c)
        m = 0.7 * m + 0.3 * (m + g.numpy() - c.numpy())
        np.testing.assert_allclose(memory.memory.numpy(), m, rtol=1e-6, atol=1e-7)


def test_dgc_memory_momentum_correction_and_factor_masking():
    memory = DGCMemory(momentum=0.9)
    u = np.zeros(6)
    v = np.zeros(6)
    for step in range(5):
        g = laplace((6,), seed=step).numpy()
        u = 0.9 * u + g
        v = v + u
        p = memory.compensate(torch.from_numpy(g).float()).numpy().copy()
        np.testing.assert_allclose(p, v, rtol=1e-5)
        top = np.argsort(-np.abs(v))[:2]
        c = np.zeros(6)
        c[top] = v[top]
        memory.update(torch.from_numpy(p), torch.from_numpy(c))
        v[top] = 0.0
        u[top] = 0.0
        np.testing.assert_allclose(memory.accumulated.numpy(), v, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(memory.velocity.numpy(), u, rtol=1e-5, atol=1e-6)


def test_dgc_reference_is_the_dense_momentum_update():
    s = scheme("dgc:momentum=0.5", 0.1, 100)
    g = laplace((100,))
    np.testing.assert_allclose(s.reference(g).numpy(), g.numpy())
    np.testing.assert_allclose(s.reference(g).numpy(), 1.5 * g.numpy(), rtol=1e-6)


# --- registry --------------------------------------------------------------------------


def test_every_registered_compressor_runs_and_reports_exact_bytes():
    d = 400
    for name, entry in REGISTRY.items():
        s = scheme(name, None if entry.fixed_rate else 0.05, d, shapes=[(20, 20)])
        exchange = s.step(laplace((2, d)))
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
    for name, nbytes in expected.items():
        s = scheme(name, None if REGISTRY[name].fixed_rate else 0.05, d, shapes=[(20, 20)])
        if name == "powersgd":
            s = scheme("powersgd:rank=2", None, d, shapes=[(20, 20)])
        assert s.step(laplace((2, d))).bytes_per_learner == nbytes, name


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


def test_sidco_compressors_take_the_reference_choices():
    (spec,) = parse_compressors("sidco-gpd:stages=3:stage_fit=mle:zeros=include")
    assert spec.label == "sidco-gpd:stages=3:zeros=include:stage_fit=mle"
    x = laplace((2, 20_000), seed=9)
    x[:, ::10] = 0.0
    built = scheme(spec.label, 0.01, 20_000)
    compressor = built.compressor
    assert (compressor.zeros, compressor.stage_fit) == ("include", "mle")
    exchange = compressor.exchange(x)
    for row, selected in zip(x, exchange.selected, strict=True):
        expected = estimate_threshold(
            row, 0.01, "sidco-gpd", stages=3, zeros="include", stage_fit="mle"
        )
        assert selected == expected.selected
    default = scheme("sidco-gpd:stages=3", 0.01, 20_000).compressor
    assert (default.zeros, default.stage_fit) == ("exclude", "moments")
    with pytest.raises(UsageError, match="zeros must be one of exclude, include"):
        parse_compressors("sidco-exp:zeros=all")


def test_a_rate_below_one_element_is_refused():
    (spec,) = parse_compressors("topk")
    with pytest.raises(UsageError, match=r"cannot honour ratio 0\.001"):
        build_scheme(spec, 0.001, 1, numel=500)
    with pytest.raises(UsageError, match="give it a ratio"):
        build_scheme(spec, None, None, numel=500)
