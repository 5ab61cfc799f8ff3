"""Collective emulation (gradstat/wire/collectives.py) against plain sequential
loops: N learners, each with its own buffers, sending one message at a time in the order
the algorithm runs, the wire format applied to each message (the formats themselves are
checked against torch's casts and the OCP spec in tests/test_formats.py). Ring and tree
equal the loops bit for bit at N = 2..16; on data where learners share a signal, the ring
that accumulates in bf16 loses precision as N grows and the all-to-all with float32 sums
does not."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from gradstat.errors import UsageError
from gradstat.wire import collectives
from gradstat.wire.collectives import Collective, all_reduce, reduce_scatter
from gradstat.wire.formats import FORMATS


def _send(fmt, message: torch.Tensor) -> torch.Tensor:
    """One message through the wire format (a one-row ``round``: equal to decoding the
    payload, tests/test_formats.py)."""
    return fmt.round(message[None])[0]


def _chunks(inputs: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """chunks[i][c]: learner i's chunk c (zero-padded to equal length)."""
    n, numel = len(inputs), inputs[0].numel()
    size = math.ceil(numel / n)
    padded = [torch.cat([x, torch.zeros(n * size - numel)]) for x in inputs]
    return [[x[c * size : (c + 1) * size].clone() for c in range(n)] for x in padded]


def _start(inputs, fmt, wire: bool) -> list[list[torch.Tensor]]:
    chunks = _chunks(inputs)
    return [[_send(fmt, c) if wire else c for c in row] for row in chunks]


def ring_loop(inputs, fmt, wire: bool) -> list[torch.Tensor]:
    """Step s: learner r sends its partial of chunk (r - s - 1) mod n to learner r + 1,
    which adds it to its own; after n - 1 steps learner c holds the sum of chunk c."""
    n = len(inputs)
    held = _start(inputs, fmt, wire)
    for step in range(n - 1):
        for r in range(n):
            c, dst = (r - step - 1) % n, (r + 1) % n
            if wire:  # the partial is a payload already; the sum is rounded
                held[dst][c] = _send(fmt, held[r][c] + held[dst][c])
            else:
                held[dst][c] = held[dst][c] + _send(fmt, held[r][c])
    return [held[c][c] for c in range(n)]


def tree_loop(inputs, fmt, wire: bool, chunks: bool = True) -> list[torch.Tensor]:
    """A binomial tree per chunk rooted at its owner (``chunks`` False: the whole vector
    to learner 0): at distance d = 1, 2, 4, ... learner v (counted from the root) with
    v mod 2d == d sends its partial to v - d."""
    n = len(inputs)
    if chunks:
        held = _start(inputs, fmt, wire)
        roots = range(n)
    else:
        held = [[_send(fmt, x) if wire else x.clone()] for x in inputs]
        roots = [0]
    for k, root in enumerate(roots):
        d = 1
        while d < n:
            for v in range(d, n, 2 * d):
                src, dst = (v + root) % n, (v - d + root) % n
                if wire:
                    held[dst][k] = _send(fmt, held[dst][k] + held[src][k])
                else:
                    held[dst][k] = held[dst][k] + _send(fmt, held[src][k])
            d *= 2
    return [held[root][k] for k, root in enumerate(roots)]


def a2a_loop(inputs, fmt, wire: bool) -> list[torch.Tensor]:
    """Learner i sends chunk c to learner c (its own stays); c sums in rank order."""
    n = len(inputs)
    chunks = _chunks(inputs)
    owned = []
    for c in range(n):
        total = None
        for i in range(n):
            part = chunks[i][c] if (i == c and not wire) else _send(fmt, chunks[i][c])
            if total is None:
                total = part
            elif wire:
                total = _send(fmt, total + part)
            else:
                total = total + part
        owned.append(total)
    return owned


LOOPS = {"ring": ring_loop, "tree": tree_loop, "a2a": a2a_loop}


def _inputs(n: int, numel: int = 301, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randn(numel, generator=g)
    return [shared + torch.randn(numel, generator=g) * 0.5 for _ in range(n)]


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


@pytest.mark.parametrize("algorithm", ["ring", "tree"])
@pytest.mark.parametrize("accumulate", ["fp32", "wire"])
@pytest.mark.parametrize("wire", ["bf16", "fp8-e4m3", "mxfp4"])
def test_ring_and_tree_equal_the_sequential_loops_bit_for_bit(algorithm, accumulate, wire):
    fmt = FORMATS[wire]
    # every N for the casts; MX (slow loops): powers of two, odd and prime N
    learners = (2, 3, 4, 7, 8, 13, 16) if wire.startswith("mx") else range(2, 17)
    for n in learners:
        inputs = _inputs(n, seed=n)
        owned = reduce_scatter(inputs, wire=wire, algorithm=algorithm, accumulate=accumulate)
        expected = LOOPS[algorithm](inputs, fmt, accumulate == "wire")
        numel = inputs[0].numel()
        assert sum(o.numel() for o in owned) == numel
        assert _equal(torch.cat(owned), torch.cat(expected)[:numel]), n


@pytest.mark.parametrize("accumulate", ["fp32", "wire"])
@pytest.mark.parametrize("wire", ["bf16", "fp8-e5m2", "mxfp6"])
def test_all_to_all_equals_the_sequential_loop(accumulate, wire):
    fmt = FORMATS[wire]
    for n in (2, 3, 8, 16):
        inputs = _inputs(n, seed=n)
        owned = reduce_scatter(inputs, wire=wire, algorithm="a2a", accumulate=accumulate)
        expected = a2a_loop(inputs, fmt, accumulate == "wire")
        assert _equal(torch.cat(owned), torch.cat(expected)[: inputs[0].numel()]), n


@pytest.mark.parametrize("algorithm", ["ring", "tree", "a2a"])
@pytest.mark.parametrize("accumulate", ["fp32", "wire"])
def test_all_reduce_is_reduce_then_one_rounding_on_the_way_back(algorithm, accumulate):
    """Ring and a2a: each owner's chunk sent once more (all-gather); tree: the whole
    vector reduced to learner 0 and broadcast; in ``wire`` mode the results are payloads
    already and are not rounded again."""
    fmt = FORMATS["fp8-e4m3"]
    wire = accumulate == "wire"
    for n in (2, 5, 16):
        inputs = _inputs(n, seed=n)
        if algorithm == "tree":
            owned = tree_loop(inputs, fmt, wire, chunks=False)
        else:
            owned = LOOPS[algorithm](inputs, fmt, wire)
        expected = torch.cat([o if wire else _send(fmt, o) for o in owned])
        total = all_reduce(inputs, wire="fp8-e4m3", algorithm=algorithm, accumulate=accumulate)
        assert _equal(total, expected[: inputs[0].numel()]), n


@pytest.mark.parametrize("wire", list(FORMATS))
def test_the_compiled_hops_equal_the_plain_reference(wire):
    """Every built-in format, algorithm and accumulation, odd lengths (short MX blocks),
    data over many magnitudes with signed zeros and float32 subnormals; fp16 sums may
    overflow to infinity (then NaN: any NaN matches)."""
    g = torch.Generator().manual_seed(3)
    for n in (1, 2, 3, 8):
        inputs = [
            torch.randn(333, generator=g) * torch.exp2(torch.randint(-30, 30, (333,), generator=g))
            for _ in range(n)
        ]
        inputs[0][:3] = torch.tensor([0.0, -0.0, 1e-44])
        for algorithm in ("ring", "tree", "a2a"):
            for accumulate in ("fp32", "wire"):
                settings = {"wire": wire, "algorithm": algorithm, "accumulate": accumulate}
                fast = all_reduce(inputs, **settings)
                assert _same(fast, all_reduce(inputs, **settings, plain=True)), (n, settings)
                fast = torch.cat(reduce_scatter(inputs, **settings))
                plain = torch.cat(reduce_scatter(inputs, **settings, plain=True))
                assert _same(fast, plain), (n, settings)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bits, or both NaN."""
    return bool(((a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())).all())


def test_exact_wire_sums_and_one_learner_needs_no_hop():
    inputs = [torch.arange(6.0) * (i + 1) for i in range(3)]
    for algorithm in ("ring", "tree", "a2a"):
        total = all_reduce(inputs, algorithm=algorithm)  # fp32, small integers: exact
        assert torch.equal(total, torch.arange(6.0) * 6)
        x = torch.randn(70)
        assert _equal(all_reduce([x], wire="bf16", algorithm=algorithm), _send(FORMATS["bf16"], x))
    stacked = torch.stack(inputs)
    assert torch.equal(Collective.named("fp32").reduce(stacked), torch.arange(6.0) * 6)
    assert collectives.relative_error(torch.arange(6.0) * 6, inputs) == 0.0


def _rms(total: torch.Tensor, inputs) -> float:
    return math.sqrt(collectives.relative_error(total, inputs))


def test_ring_in_bf16_loses_precision_with_n_and_all_to_all_in_fp32_does_not():
    """Learners share a signal (the sum grows with N): each hop of the bf16 ring rounds a
    larger partial sum, so the rms error grows (towards sqrt(N)); the all-to-all rounds
    each input once and sums in float32, so its error stays flat or falls. Checked on the
    sequential loops and on the emulation (equal)."""
    ring, a2a = [], []
    fmt = FORMATS["bf16"]
    for n in (2, 4, 8, 16):
        g = torch.Generator().manual_seed(n)
        shared = torch.randn(8192, generator=g)
        inputs = [shared + 0.3 * torch.randn(8192, generator=g) for _ in range(n)]
        ring_total = torch.cat(ring_loop(inputs, fmt, wire=True))
        a2a_total = torch.cat(a2a_loop(inputs, fmt, wire=False))
        assert _equal(ring_total, all_reduce(inputs, wire="bf16", accumulate="wire"))
        assert _equal(a2a_total, torch.cat(reduce_scatter(inputs, wire="bf16", algorithm="a2a")))
        ring.append(_rms(ring_total, inputs))
        a2a.append(_rms(a2a_total, inputs))
    assert all(b > a for a, b in itertools.pairwise(ring)), ring
    assert ring[-1] > 1.5 * ring[0], ring
    assert all(b <= a * 1.05 for a, b in itertools.pairwise(a2a)), a2a
    assert a2a[-1] < ring[-1] / 2, (a2a, ring)


def test_bad_settings_are_usage_errors():
    with pytest.raises(UsageError, match="algorithm must be one of ring, tree, a2a"):
        reduce_scatter([torch.zeros(3)] * 2, algorithm="butterfly")
    with pytest.raises(UsageError, match="accumulate must be one of fp32, wire"):
        Collective.named("bf16", accumulate="fp64")
    with pytest.raises(UsageError, match="same number of values"):
        all_reduce([torch.zeros(3), torch.zeros(4)])
