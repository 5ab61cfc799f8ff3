"""The alpha-beta cost model and the bandwidth / latency parsers, on hand-computed cases."""

from __future__ import annotations

import pytest

from gradstat.compressors.cost import (
    Link,
    allgather_seconds,
    allreduce_seconds,
    collective_seconds,
    parse_bandwidth,
    parse_latency,
    parse_link,
    tree_seconds,
)
from gradstat.errors import UsageError

LINK = Link(bandwidth=1.25e9, latency=5e-6)  # 10 Gbit/s, 5 us


def test_ring_allreduce_by_hand():
    # 2 (n-1) a + 2 (n-1)/n s b = 2*3*5us + 2*3/4 * 1e6 B / 1.25e9 B/s = 30us + 1.2ms
    assert allreduce_seconds(1e6, 4, LINK) == pytest.approx(30e-6 + 1.2e-3)
    assert collective_seconds("allreduce", 1e6, 4, LINK) == allreduce_seconds(1e6, 4, LINK)


def test_allgather_by_hand():
    # (n-1) (a + s b) = 3 * (5us + 0.8ms)
    assert allgather_seconds(1e6, 4, LINK) == pytest.approx(3 * (5e-6 + 0.8e-3))


@pytest.mark.parametrize(("n", "rounds"), [(2, 1), (4, 2), (5, 3), (8, 3), (9, 4)])
def test_tree_broadcast_and_reduce_take_ceil_log2_rounds(n, rounds):
    expected = rounds * (5e-6 + 4000 / 1.25e9)
    assert tree_seconds(4000, n, LINK) == pytest.approx(expected)
    assert collective_seconds("broadcast", 4000, n, LINK) == pytest.approx(expected)
    assert collective_seconds("reduce", 4000, n, LINK) == pytest.approx(expected)


def test_one_learner_communicates_nothing():
    for collective in ("allreduce", "allgather", "broadcast", "reduce"):
        assert collective_seconds(collective, 1e6, 1, LINK) == 0.0


def test_unknown_collective():
    with pytest.raises(ValueError, match="unknown collective"):
        collective_seconds("scatter", 1.0, 2, LINK)


@pytest.mark.parametrize("n", [2, 4, 16])
def test_sparse_allgather_beats_dense_allreduce_below_density_one_over_n(n):
    """docs/methods.md 5: with 4-byte indices and values and no latency, an all-gather of k
    pairs beats the dense ring all-reduce exactly when k/d < 1/n."""
    link = Link(bandwidth=1e9, latency=0.0)
    d = 1_000_000
    dense = allreduce_seconds(4 * d, n, link)
    below, above = d // n - 1, d // n + 1
    assert allgather_seconds(8 * below, n, link) < dense < allgather_seconds(8 * above, n, link)
    assert allgather_seconds(8 * d / n, n, link) == pytest.approx(dense)


@pytest.mark.parametrize(
    ("text", "bytes_per_second"),
    [
        ("10Gbit/s", 1.25e9),
        ("10Gbps", 1.25e9),
        ("10 Gb/s", 1.25e9),
        ("1.25GB/s", 1.25e9),
        ("100Mbit/s", 12.5e6),
        ("1GiB/s", 2.0**30),
        ("800 MiB/s", 800 * 2.0**20),
        ("1e9B/s", 1e9),
        ("25 gbit/s", 25e9 / 8),
    ],
)
def test_parse_bandwidth(text, bytes_per_second):
    assert parse_bandwidth(text) == pytest.approx(bytes_per_second)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("5us", 5e-6), ("5µs", 5e-6), ("0.2ms", 2e-4), ("100ns", 1e-7), ("1e-5s", 1e-5), ("0s", 0)],
)
def test_parse_latency(text, seconds):
    assert parse_latency(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["fast", "10", "10Gbit", "-1Gbit/s", "0Gbit/s", "10 Xb/s", ""])
def test_bad_bandwidths(text):
    with pytest.raises(UsageError, match="--bandwidth"):
        parse_bandwidth(text)


@pytest.mark.parametrize("text", ["5", "five us", "5 parsecs", "-1us"])
def test_bad_latencies(text):
    with pytest.raises(UsageError, match="--latency"):
        parse_latency(text)


def test_parse_link():
    link = parse_link("8Gbit/s", "1ms")
    assert link.bandwidth == pytest.approx(1e9) and link.latency == pytest.approx(1e-3)
    assert link.beta == pytest.approx(1e-9)
