"""Fused one-pass loops over a float32 row on the CPU (numba), where numpy would need a
pass per operation.

A step of a top-k set analysis touches each learner's row once: check it is finite, add it
to the running compensated sum of the step (Kahan 1965: y = x - c, t = s + y,
c = (t - s) - y, s = t) and collect the candidates |x| >= t of its top-k (the sampled
threshold of :func:`gradstat.stats.topk_sets.topk_indices`). numpy runs these as eight
passes (abs, compare, nonzero, sum and Kahan's four), each over memory; the row is longer
than any cache, so the loop here does all of it in one pass over cache-sized pieces.
Measured on 8M values, one thread: 7 ms against 19.5 ms. The sum is bit for bit numpy's
(the same operations in the same order, no fast-math), and the candidates are the same
indices in the same (ascending) order.

Replay uses the same loops: error feedback's ``p = m + g`` with its top-k candidates,
the reference sum with the finiteness check, and float64 sums of squares in side-by-side
partial sums (LLVM vectorizes them; one running float64 sum would wait on each add).

|x| >= t is compared on the float32 bit patterns with the sign bit cleared, as integers:
for non-negative floats the two orders agree, and the largest pattern seen also tells
whether any value is NaN or Inf (patterns from 0x7F800000 up).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import numpy as np

#: The smallest |x| bit pattern of Inf and NaN (float32).
NONFINITE_BITS = 0x7F800000
#: A threshold pattern above every float32 pattern: no candidates.
NO_CANDIDATES = 1 << 31
#: Room for indices before :func:`indices_at_least` needs a second pass.
ROOM = 1 << 16


def _threshold_bits(threshold: float | None, inclusive: bool = True) -> int:
    """The |x| bit pattern a value must reach to pass ``|x| >= threshold`` (``>`` unless
    ``inclusive``), the threshold rounded to float32 as numpy compares a float32 array
    with a Python float: ``NO_CANDIDATES`` for None or NaN (nothing passes), 0 below zero
    (everything but NaN passes), -0.0 as +0.0."""
    if threshold is None:
        return NO_CANDIDATES
    limit = np.float32(threshold)
    if limit != limit:
        return NO_CANDIDATES
    if limit < 0:
        return 0
    bits = int(limit.view(np.int32)) & 0x7FFFFFFF  # -0.0 as +0.0
    return bits if inclusive else bits + 1


def _found(loops: ModuleType, x: np.ndarray, bits: int, out: np.ndarray, count: int) -> np.ndarray:
    """The ``count`` indices a first pass found: ``out[:count]``, or, when they did not
    fit in ``out``, a second pass (candidates only) into a buffer of that size."""
    if count > out.size:
        out = np.empty(count, dtype=np.int64)
        loops.candidates(x, bits, out, 0, 0)
    return out[:count]


def _loops() -> ModuleType:
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
    machine-code cache is read and LLVM starts) cost about 0.7 s once per process, paid
    here instead of inside the first scan (what a benchmark timing per step wants)."""
    one = np.zeros(1, dtype=np.float32)
    scan_row(one, None, np.empty(1, dtype=np.int64), one.copy(), one.copy())


def scan_row(
    x: np.ndarray,
    threshold: float | None,
    out: np.ndarray,
    total: np.ndarray | None = None,
    error: np.ndarray | None = None,
    first: bool = False,
) -> tuple[np.ndarray, bool]:
    """One pass over the float32 row ``x``: the indices (int64, ascending) of
    ``|x| >= threshold`` (none when ``threshold`` is None), and whether every value is
    finite. With ``total`` and ``error`` (a compensated sum, float32, as long as ``x``),
    also adds ``x`` to it, or makes it ``x`` when ``first`` (no copy when ``x`` is
    ``total`` itself). ``out``: int64 room for the indices; when more are found, a
    second pass (candidates only) into a buffer of the right size."""
    loops = _loops()
    if total is None:
        mode = loops.SUM_NONE
        total = error = x  # unused
    elif not first:
        mode = loops.SUM_ADD
    else:
        mode = loops.SUM_ZERO_ERROR if np.shares_memory(x, total) else loops.SUM_FIRST
    bits = _threshold_bits(threshold)
    count, worst = loops.scan(x, total, error, mode, bits, out)
    return _found(loops, x, bits, out, count), worst < NONFINITE_BITS


def indices_at_least(x: np.ndarray, threshold: float, inclusive: bool = True) -> np.ndarray:
    """The indices (int64, ascending) of ``|x| >= threshold`` (``>`` unless ``inclusive``)
    in the float32 row ``x``, compared in float32 as numpy compares a float32 array with a
    Python float (NaN never selected); one pass, two when more than ``ROOM`` are found."""
    loops = _loops()
    bits = _threshold_bits(threshold, inclusive)
    out = np.empty(min(ROOM, x.size), dtype=np.int64)
    count, _ = loops.candidates(x, bits, out, 0, 0)
    return _found(loops, x, bits, out, count)


def squared_norm(x: np.ndarray) -> float:
    """sum x^2 of a float32 row, accumulated in float64."""
    return float(_loops().sum_squares(x))


def error_sums(estimate: np.ndarray, reference: np.ndarray) -> tuple[float, float, float, float]:
    """(||r||^2, ||e||^2, e . r, ||e - r||^2) of two float32 rows, in float64, one pass."""
    ref_sq, est_sq, dot, err = _loops().error_sums(estimate, reference)
    return float(ref_sq), float(est_sq), float(dot), float(err)


def add_checked(x: np.ndarray, total: np.ndarray) -> bool:
    """``total += x`` (float32) in one pass that also tells whether every x is finite."""
    return bool(_loops().add_checked(np.ascontiguousarray(x), total) < NONFINITE_BITS)


def add_and_candidates(
    x: np.ndarray, g: np.ndarray, threshold: float | None, out: np.ndarray
) -> np.ndarray:
    """``x += g`` in place (float32, as numpy adds) in one pass that also finds the
    indices (ascending) of the new ``|x| >= threshold`` (none when None): error feedback's
    corrected row ``p = m + g`` and its top-k candidates. ``out``: int64 room for the
    indices; when more are found, a second pass."""
    loops = _loops()
    bits = _threshold_bits(threshold)
    count, _ = loops.add_candidates(x, g, bits, out)
    return _found(loops, x, bits, out, count)
