"""Alpha-beta communication cost model (docs/methods.md section 5).

A message of ``s`` bytes between two learners costs ``alpha + s * beta`` seconds, with
``alpha`` the latency and ``beta = 1 / bandwidth``. Per learner per step (Thakur,
Rabenseifner and Gropp 2005, "Optimization of collective communication operations in
MPICH"; Patarasuk and Yuan 2009 for the bandwidth-optimal ring):

* ring all-reduce of ``s`` bytes:     ``2 (n-1) alpha + 2 (n-1)/n s beta``
* ring all-gather, ``s`` per learner:  ``(n-1) alpha + (n-1) s beta``
* ring (or all-to-all) reduce-scatter of ``s`` bytes: ``(n-1) alpha + (n-1)/n s beta``
  (FSDP's gradient reduction; half an all-reduce)
* binomial-tree broadcast or reduce:  ``ceil(log2 n) (alpha + s beta)``

One learner (n = 1) communicates nothing. Bandwidths and latencies are parsed from
strings such as ``10Gbit/s``, ``1.25GB/s``, ``5us`` or ``0.2ms``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from gradstat.errors import UsageError

_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BINARY = {"ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}
_BANDWIDTH = re.compile(
    r"^\s*(?P<num>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*"
    r"(?P<prefix>[kKmMgGtT]i?)?(?P<unit>bit|bits|b|byte|bytes|B)\s*(?:/\s*s|ps)\s*$"
)
_LATENCY = re.compile(
    r"^\s*(?P<num>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(?P<unit>s|ms|us|µs|μs|ns)\s*$"
)
_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ns": 1e-9}


@dataclass(frozen=True)
class Link:
    """A network: ``bandwidth`` in bytes per second and ``latency`` (alpha) in seconds."""

    bandwidth: float
    latency: float

    def __post_init__(self) -> None:
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise UsageError(f"bandwidth must be positive, got {self.bandwidth}")
        if not (self.latency >= 0 and math.isfinite(self.latency)):
            raise UsageError(f"latency must be >= 0, got {self.latency}")

    @property
    def beta(self) -> float:
        """Seconds per byte."""
        return 1.0 / self.bandwidth


def parse_bandwidth(text: str) -> float:
    """Bytes per second from ``10Gbit/s``, ``10Gbps``, ``1.25GB/s``, ``800MiB/s``.

    A lower-case ``b`` or ``bit`` means bits, an upper-case ``B`` or ``byte`` bytes;
    ``k/M/G/T`` are powers of 1000 and ``Ki/Mi/Gi/Ti`` powers of 1024.
    """
    match = _BANDWIDTH.match(text)
    if not match:
        raise UsageError(
            f"--bandwidth {text!r}: expected a rate such as 10Gbit/s, 25Gbps or 1.25GB/s"
        )
    prefix = (match["prefix"] or "").lower()
    scale = _BINARY[prefix] if prefix.endswith("i") else _PREFIX[prefix]
    bits = match["unit"] in ("b", "bit", "bits")
    value = float(match["num"]) * scale / (8.0 if bits else 1.0)
    if value <= 0:
        raise UsageError(f"--bandwidth {text!r}: must be positive")
    return value


def parse_latency(text: str) -> float:
    """Seconds from ``5us``, ``5µs``, ``0.2ms``, ``100ns`` or ``1e-5s``."""
    match = _LATENCY.match(text)
    if not match:
        raise UsageError(f"--latency {text!r}: expected a time such as 5us, 0.2ms or 1e-5s")
    return float(match["num"]) * _SECONDS[match["unit"]]


def parse_link(bandwidth: str, latency: str) -> Link:
    """A :class:`Link` from the ``--bandwidth`` and ``--latency`` strings."""
    return Link(parse_bandwidth(bandwidth), parse_latency(latency))


def allreduce_seconds(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce of ``nbytes`` per learner: ``2(n-1) a + 2(n-1)/n s b``."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * link.latency + 2 * (n - 1) / n * nbytes * link.beta


def allgather_seconds(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather of ``nbytes`` from each learner: ``(n-1) a + (n-1) s b``."""
    if n <= 1:
        return 0.0
    return (n - 1) * (link.latency + nbytes * link.beta)


def reducescatter_seconds(nbytes: float, n: int, link: Link) -> float:
    """Ring reduce-scatter of ``nbytes`` per learner: ``(n-1) a + (n-1)/n s b``."""
    if n <= 1:
        return 0.0
    return (n - 1) * link.latency + (n - 1) / n * nbytes * link.beta


def tree_seconds(nbytes: float, n: int, link: Link) -> float:
    """Binomial-tree broadcast or reduce of ``nbytes``: ``ceil(log2 n) (a + s b)``."""
    if n <= 1:
        return 0.0
    return math.ceil(math.log2(n)) * (link.latency + nbytes * link.beta)


#: Each collective's time: ``seconds(nbytes per learner, n, link)``.
SECONDS = {
    "allreduce": allreduce_seconds,
    "allgather": allgather_seconds,
    "reducescatter": reducescatter_seconds,
    "broadcast": tree_seconds,
    "reduce": tree_seconds,
}


def collective_seconds(collective: str, nbytes: float, n: int, link: Link) -> float:
    """Predicted seconds of one collective call with ``nbytes`` per learner."""
    if collective not in SECONDS:
        raise ValueError(f"unknown collective {collective!r}; expected one of {tuple(SECONDS)}")
    return SECONDS[collective](nbytes, n, link)
