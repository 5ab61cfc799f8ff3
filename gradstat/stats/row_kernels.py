"""Fused one-pass loops over a float32 row on the CPU (numba), where numpy would need a
pass per operation.

A step of a top-k set analysis touches each learner's row once: check it is finite, add it
to the running compensated sum of the step (:func:`~gradstat.stats.row_plain.
compensated_add`, Kahan 1965) and collect the candidates |x| >= t of its top-k (the
sampled threshold of :func:`gradstat.stats.topk_sets.topk_indices`). numpy runs these as
eight passes (abs, compare, nonzero, sum and Kahan's four), each over memory; the row is
longer than any cache, so the loop here does all of it in one pass over cache-sized
pieces (figures: docs/large.md). The sum is bit for bit numpy's (the same operations in
the same order, no fast-math), and the candidates are the same indices in the same
(ascending) order.

Replay uses the same loops: DGC's momentum, the reference sum with the finiteness check,
and float64 sums of squares (their adds alone may be reassociated, so that LLVM
vectorizes them; each term is exact and the sum float64-accurate in any order).

|x| >= t is compared in float32 as numpy compares (NaN never passes), each block of 64
values counted first in vector instructions. Whether a row is finite is an integer OR
over its bit patterns, taken inside whichever loop reads the row (free where that loop
waits on memory).

Each function has a plain numpy twin of the same name and contract in
:mod:`gradstat.stats.row_plain`, which the tests compare it with and
``benchmarks/scale.py --plain loops`` runs in its place (docs/large.md, "Fast paths").
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import numpy as np

#: Bit 31 of the loops' finiteness flags: set when some value was NaN or Inf.
NONFINITE = 1 << 31
#: Room for indices before :func:`indices_at_least` needs a second pass.
ROOM = 1 << 16


def float32_limit(threshold: float | None, inclusive: bool = True) -> np.float32:
    """The float32 ``t`` of the loops' ``|x| >= t`` that passes exactly ``|x| >= threshold``
    (``>`` unless ``inclusive``), the threshold rounded to float32 as numpy compares a
    float32 array with a Python float: NaN (nothing passes) for None, NaN and ``> inf``;
    ``|x| > t`` as ``|x| >= `` the next float32 up."""
    if threshold is None:
        return np.float32(np.nan)
    with np.errstate(over="ignore"):  # a huge threshold is +inf in float32
        limit = np.float32(threshold)
    if inclusive or limit != limit:
        return limit
    if limit == np.inf:
        return np.float32(np.nan)
    return np.nextafter(limit, np.float32(np.inf))


def _finite(flags: int) -> bool:
    """Whether a loop's finiteness flags saw only finite values."""
    return not int(flags) & NONFINITE


class Room:
    """Room for the candidates a scan finds (a caller that scans many rows keeps one):
    their indices (int64) and their magnitudes |x| (float32), so that the top-k among
    them needs no gather from the row."""

    def __init__(self, size: int) -> None:
        self.indices = np.empty(size, dtype=np.int64)
        self.magnitudes = np.empty(size, dtype=np.float32)

    @property
    def size(self) -> int:
        return self.indices.size


class Found(NamedTuple):
    """A scan's candidates (indices ascending, and |x| at each; views of its
    :class:`Room`, valid until the room is reused) and whether the row was finite."""

    indices: np.ndarray
    magnitudes: np.ndarray
    finite: bool


def _found(
    compiled: ModuleType, x: np.ndarray, threshold: np.float32, room: Room, count: int
) -> tuple[np.ndarray, np.ndarray]:
    """The ``count`` candidates a first pass found in ``room``, or, when they did not
    fit, a second pass (candidates only) into a room of that size."""
    if count > room.size:
        room = Room(count)
        compiled.candidates(x, threshold, room.indices, room.magnitudes, 0, 0)
    return room.indices[:count], room.magnitudes[:count]


def loops() -> ModuleType:
    """:mod:`gradstat.stats._row_loops`, imported on first use (see :func:`load`), so only
    a process that scans a row on the CPU pays numba's start. numba caches the machine
    code beside the module, or in the user's cache folder; where neither can be written
    (a read-only install and home), in a folder of the temporary directory instead of
    failing to import."""
    if "gradstat.stats._row_loops" not in sys.modules and "NUMBA_CACHE_DIR" not in os.environ:
        here = Path(__file__).parent
        home_cache = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
        if not any(os.access(folder, os.W_OK) for folder in (here, home_cache)):
            folder = Path(tempfile.gettempdir()) / f"gradstat-numba-{os.getuid()}"
            os.environ["NUMBA_CACHE_DIR"] = str(folder)
    from gradstat.stats import _row_loops

    return _row_loops


def load() -> None:
    """Load the compiled loops now: numba's import and its first call in a process (the
    machine-code cache is read and LLVM starts) cost once per process, paid here
    instead of inside the first scan (what a benchmark timing per step wants)."""
    one = np.zeros(1, dtype=np.float32)
    scan_row(one, None, Room(1), one.copy(), one.copy())


def scan_row(
    x: np.ndarray,
    threshold: float | None,
    room: Room,
    total: np.ndarray | None = None,
    error: np.ndarray | None = None,
    first: bool = False,
) -> Found:
    """One pass over the float32 row ``x``: the candidates ``|x| >= threshold`` (none when
    ``threshold`` is None) and whether every value is finite. With ``total`` and ``error``
    (a compensated sum, float32, as long as ``x``), also adds ``x`` to it, or makes it
    ``x`` when ``first``. ``room``: for the candidates; when more are found, a second
    pass (candidates only) into a larger one."""
    compiled = loops()
    if total is None:
        mode = compiled.SUM_NONE
        total = error = x  # unused
    else:
        mode = compiled.SUM_FIRST if first else compiled.SUM_ADD
    limit = float32_limit(threshold)
    count, flags = compiled.scan(x, total, error, mode, limit, room.indices, room.magnitudes)
    return Found(*_found(compiled, x, limit, room, count), _finite(flags))


def mean_row(
    total: np.ndarray,
    error: np.ndarray,
    n: int,
    mean: np.ndarray,
    threshold: float | None,
    room: Room,
) -> tuple[np.ndarray, np.ndarray, float]:
    """The mean of ``n`` rows from their compensated sum, ``(total - error) / n`` in
    float32 (torch's ``sub`` and ``div_``, bit for bit) into ``mean``, in one pass with its
    candidates ``|mean| >= threshold`` (indices and magnitudes, as :func:`scan_row`) and
    its sum of squares in float64."""
    compiled = loops()
    limit = float32_limit(threshold)
    count, squares = compiled.mean_scan(
        total, error, np.float32(n), mean, limit, room.indices, room.magnitudes
    )
    return *_found(compiled, mean, limit, room, count), float(squares)


def indices_at_least(x: np.ndarray, threshold: float, inclusive: bool = True) -> np.ndarray:
    """The indices (int64, ascending) of ``|x| >= threshold`` (``>`` unless ``inclusive``)
    in the float32 row ``x``, compared in float32 as numpy compares a float32 array with a
    Python float (NaN never selected); one pass, two when more than ``ROOM`` are found."""
    compiled = loops()
    limit = float32_limit(threshold, inclusive)
    room = Room(min(ROOM, x.size))
    count = compiled.candidates(x, limit, room.indices, room.magnitudes, 0, 0)
    return _found(compiled, x, limit, room, count)[0]


def magnitudes_at_least(x: np.ndarray, threshold: float, inclusive: bool = True) -> np.ndarray:
    """|x| (float32) of the values :func:`indices_at_least` selects, in the row's order: the
    same as compacting ``abs(x)`` with numpy's ``>=`` (``>``), without a row-sized
    ``abs(x)``: a count, then the compaction into an array of that size."""
    compiled = loops()
    limit = float32_limit(threshold, inclusive)
    out = np.empty(int(compiled.count_at_least(x, limit)) + 1, dtype=np.float32)
    return out[: compiled.compact_at_least(x, limit, out)]


def count_at_least(x: np.ndarray, threshold: float, inclusive: bool = True) -> int:
    """How many values :func:`indices_at_least` selects (one pass in vector instructions)."""
    return int(loops().count_at_least(x, float32_limit(threshold, inclusive)))


def magnitude_sums(x: np.ndarray) -> tuple[float, float, float, float, int]:
    """(sum x, sum |x|, sum x^2, max |x|, how many x_j == 0) of a float32 row in one pass
    over cache-sized pieces, the sums in float64. A NaN or Inf makes the sums NaN or Inf."""
    signed, total, squares, bits, zeros = loops().magnitude_sums(x)
    maximum = float(np.array(bits, dtype=np.int32).view(np.float32))
    return float(signed), float(total), float(squares), maximum, int(zeros)


def count_nonzero(x: np.ndarray) -> int:
    """How many values of the float32 row are not zero (NaN counts, as numpy counts it)."""
    return x.size - int(loops().zeros_in(x))


def momentum_add(u: np.ndarray, v: np.ndarray, g: np.ndarray, momentum: float) -> tuple[int, float]:
    """DGC's momentum correction and accumulation, ``u = momentum u + g; v = v + u``, in
    one pass: bit for bit torch's ``u.mul_(momentum).add_(g)`` and ``v.add_(u)`` (float32,
    each product and sum rounded as written), which take three passes. Returns the new
    ``v``'s zeros and float64 sum of squares, taken while each piece is in cache: what
    DGC's threshold and the memory's norm would otherwise read the row again for."""
    zeros, squares = loops().momentum_add_stats(u, v, np.ascontiguousarray(g), np.float32(momentum))
    return int(zeros), float(squares)


def squared_norm(x: np.ndarray) -> float:
    """sum x^2 of a float32 row, accumulated in float64."""
    return float(loops().sum_squares(x))


def error_sums(estimate: np.ndarray, reference: np.ndarray) -> tuple[float, float, float, float]:
    """(||r||^2, ||e||^2, e . r, ||e - r||^2) of two float32 rows, in float64, one pass."""
    ref_sq, est_sq, dot, err = loops().error_sums(estimate, reference)
    return float(ref_sq), float(est_sq), float(dot), float(err)


def add_checked(x: np.ndarray, total: np.ndarray) -> bool:
    """``total += x`` (float32) in one pass that also tells whether every x is finite."""
    return _finite(loops().add_checked(np.ascontiguousarray(x), total))
