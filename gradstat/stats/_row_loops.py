"""The compiled loops behind :mod:`gradstat.stats.row_kernels` (numba, no fast-math:
each float operation is the one written, in the order written; the one exception are
the float64 sums of squares, which may be added in any order (``_SUMS``: LLVM then
vectorizes them; each
term is a float32 value squared in float64, exactly, and the sum stays float64-accurate
in any order). Compiled once and cached next to this file (numba's ``cache=True``), so a
later process only loads them."""

import numpy as np
from numba import njit

#: What :func:`scan` does with the running compensated sum.
SUM_NONE, SUM_FIRST, SUM_ADD = 0, 1, 2
#: Values per piece of :func:`scan`: x, the sum and its compensation stay in L2
#: (3 x 64 KiB).
PIECE = 1 << 14
#: Values per block of :func:`candidates`' first test: LLVM vectorizes the count of a
#: block, and one block in six holds a candidate at k/d = 0.1% (blocks of 16 were not
#: vectorized, blocks of 128 hold a candidate too often).
BLOCK = 64

#: A value's exponent bits; all set for Inf and NaN.
EXPONENT = 0x7F800000
#: The exponent's lowest bit: ``(bits & EXPONENT) + EXPONENT_LOW`` reaches bit 31 exactly
#: when the exponent is all ones, so an OR of these over a row tells whether any value is
#: NaN or Inf (an integer OR, which LLVM vectorizes inside any loop).
EXPONENT_LOW = 0x00800000
_OPTIONS = {"cache": True, "nogil": True, "boundscheck": False}
#: The float64 sums of squares: their adds may be reassociated, nothing else.
_SUMS = {**_OPTIONS, "fastmath": {"reassoc"}}


@njit(**_OPTIONS)
def nonfinite_flag(bits):
    """Bit 31 set exactly when the float32 bit pattern ``bits`` is NaN or Inf."""
    return (bits & EXPONENT) + EXPONENT_LOW


@njit(**_OPTIONS)
def flags_of(x):
    """The OR of :func:`nonfinite_flag` over ``x``."""
    bits = x.view(np.int32)
    flags = 0
    for j in range(x.size):
        flags |= nonfinite_flag(bits[j])
    return flags


@njit(inline="always", **_OPTIONS)
def kahan_step(s, c, x):
    """(s, c) after adding ``x`` to the sum ``s`` with compensation ``c``: the loop form
    of :func:`gradstat.stats.row_plain.compensated_add` (Kahan 1965), the same operations
    in the same order. (Inlined into each loop, see :func:`block_hits`.)"""
    y = x - c
    t = s + y
    return t, (t - s) - y


@njit(**_OPTIONS)
def kahan_add(x, s, c):
    """s, c += x with Kahan's compensation (:func:`kahan_step`), elementwise; returns the
    OR of :func:`nonfinite_flag` over ``x``."""
    bits = x.view(np.int32)
    flags = 0
    for j in range(x.size):
        s[j], c[j] = kahan_step(s[j], c[j], x[j])
        flags |= nonfinite_flag(bits[j])
    return flags


@njit(**_OPTIONS)
def candidates(x, threshold, out, magnitudes, count, offset):
    """Append ``j + offset`` for each ``|x[j]| >= threshold`` (float32; NaN never, and
    nothing for a NaN threshold: numpy's ``>=``) to ``out``, and ``|x[j]|`` to
    ``magnitudes`` (which may be shorter, even empty), from position ``count`` (counting
    past their ends without writing); returns the new count. Each block of ``BLOCK``
    values is counted first (:func:`block_hits`), then searched only when it holds one."""
    n = x.size
    end = n - n % BLOCK
    for b in range(0, end, BLOCK):
        if block_hits(x, b, threshold):
            count = search(x, b, b + BLOCK, threshold, out, magnitudes, count, offset)
    return search(x, end, n, threshold, out, magnitudes, count, offset)


@njit(inline="always", **_OPTIONS)
def search(x, lo, hi, threshold, out, magnitudes, count, offset):
    """:func:`candidates` of ``x[lo:hi]``, one value at a time."""
    for j in range(lo, hi):
        magnitude = abs(x[j])
        if magnitude >= threshold:
            if count < out.size:
                out[count] = j + offset
            if count < magnitudes.size:
                magnitudes[count] = magnitude
            count += 1
    return count


@njit(inline="always", **_OPTIONS)
def block_hits(x, b, threshold):
    """How many |x_j| >= threshold in the block of ``BLOCK`` values from ``b``. (Inlined
    where it is called, as numba's IR: as a call of its own, or written as a loop with
    a variable end, the count is not vectorized.)"""
    hits = 0
    for j in range(b, b + BLOCK):
        hits += np.int32(abs(x[j]) >= threshold)
    return hits


@njit(**_OPTIONS)
def scan(x, s, c, mode, threshold, out, magnitudes):
    """:func:`candidates` of the whole of ``x`` and, piece by piece while the piece is in
    cache, the running sum's update ``mode``. Returns (count, flags of x)."""
    count, flags = 0, 0
    for lo in range(0, x.size, PIECE):
        hi = min(x.size, lo + PIECE)
        if mode == SUM_ADD:
            flags |= kahan_add(x[lo:hi], s[lo:hi], c[lo:hi])
        else:
            if mode == SUM_FIRST:
                s[lo:hi] = x[lo:hi]
                c[lo:hi] = 0
            flags |= flags_of(x[lo:hi])
        count = candidates(x[lo:hi], threshold, out, magnitudes, count, lo)
    return count, flags


@njit(**_OPTIONS)
def mean_scan(s, c, n, mean, threshold, out, magnitudes):
    """The mean ``(s - c) / n`` (float32, as torch's ``sub`` and ``div_``) into ``mean``,
    its :func:`candidates` and its sum of squares (float64, :func:`sum_squares`), piece
    by piece while the piece is in cache. Returns (count, sum of squares)."""
    count, squares = 0, 0.0
    for lo in range(0, s.size, PIECE):
        hi = min(s.size, lo + PIECE)
        compensated_mean(s[lo:hi], c[lo:hi], n, mean[lo:hi])
        count = candidates(mean[lo:hi], threshold, out, magnitudes, count, lo)
        squares += sum_squares(mean[lo:hi])
    return count, squares


@njit(**_OPTIONS)
def compensated_mean(s, c, n, mean):
    """mean = (s - c) / n, elementwise (a loop of its own: LLVM vectorizes it over a
    slice, not over a range of a longer array)."""
    for j in range(s.size):
        mean[j] = (s[j] - c[j]) / n


@njit(**_SUMS)
def sum_squares(x):
    """sum x_j^2 in float64 (each square exact)."""
    total = 0.0
    for j in range(x.size):
        v = np.float64(x[j])
        total += v * v
    return total


@njit(**_OPTIONS)
def magnitude_sums(x):
    """(sum x, sum |x|, sum x^2, the bit pattern of max |x|, how many x_j == 0) of a
    float32 row, the sums in float64 (each term exact), piece by piece while the piece is
    in cache, one simple loop per quantity (so that each is vectorized). A NaN or Inf
    reaches the sums."""
    signed = total = squares = 0.0
    maximum = np.int32(0)
    zeros = 0
    for lo in range(0, x.size, PIECE):
        piece = x[lo : min(x.size, lo + PIECE)]
        piece_signed, piece_total, piece_squares, piece_zeros = piece_sums(piece)
        signed += piece_signed
        total += piece_total
        squares += piece_squares
        zeros += piece_zeros
        maximum = max(maximum, abs_max_bits(piece))
    return signed, total, squares, maximum, zeros


@njit(**_SUMS)
def piece_sums(x):
    """(sum x, sum |x|, sum x^2, how many x_j == 0), the sums in float64."""
    signed = total = squares = 0.0
    zeros = 0
    for j in range(x.size):
        v = np.float64(x[j])
        signed += v
        total += abs(v)
        squares += v * v
        zeros += np.int64(x[j] == 0)
    return signed, total, squares, zeros


@njit(**_OPTIONS)
def abs_max_bits(x):
    """The bit pattern of max |x_j| (float32): the largest of the patterns with the sign
    bit cleared, whose integer order is the order of the magnitudes (an integer maximum
    is vectorized, a float one that must respect NaN is not; NaN patterns sort above
    Inf, and the sums then say NaN anyway)."""
    bits = x.view(np.int32)
    maximum = np.int32(0)
    for j in range(x.size):
        b = bits[j] & np.int32(0x7FFFFFFF)
        maximum = b if b > maximum else maximum
    return maximum


@njit(**_SUMS)
def error_sums(e, r):
    """(sum r^2, sum e^2, sum e r, sum (e - r)^2) in float64."""
    ref_sq = est_sq = dot = err = 0.0
    for j in range(e.size):
        ev, rv = np.float64(e[j]), np.float64(r[j])
        d = ev - rv
        ref_sq += rv * rv
        est_sq += ev * ev
        dot += ev * rv
        err += d * d
    return ref_sq, est_sq, dot, err


@njit(**_OPTIONS)
def add_checked(x, total):
    """total += x (float32, elementwise); returns the flags of x."""
    bits = x.view(np.int32)
    flags = 0
    for j in range(x.size):
        total[j] += x[j]
        flags |= nonfinite_flag(bits[j])
    return flags


@njit(**_OPTIONS)
def zeros_in(x):
    """How many x_j == 0 (either sign; NaN is not)."""
    count = 0
    for j in range(x.size):
        count += np.int32(x[j] == 0)
    return count


@njit(**_OPTIONS)
def momentum_add(u, v, g, momentum):
    """u = u * momentum + g, then v = v + u (float32, elementwise)."""
    for j in range(u.size):
        uj = u[j] * momentum + g[j]
        u[j] = uj
        v[j] = v[j] + uj


@njit(**_OPTIONS)
def momentum_add_stats(u, v, g, momentum):
    """:func:`momentum_add` piece by piece and, while each piece of the new v is in
    cache, its zeros and float64 sum of squares; returns (zeros, squares)."""
    zeros = 0
    squares = 0.0
    for lo in range(0, u.size, PIECE):
        hi = min(u.size, lo + PIECE)
        momentum_add(u[lo:hi], v[lo:hi], g[lo:hi], momentum)
        zeros += zeros_in(v[lo:hi])
        squares += sum_squares(v[lo:hi])
    return zeros, squares


@njit(**_OPTIONS)
def count_at_least(x, threshold):
    """How many |x_j| >= threshold (float32; NaN never)."""
    total = 0
    n = x.size
    end = n - n % BLOCK
    for b in range(0, end, BLOCK):
        total += block_hits(x, b, threshold)
    for j in range(end, n):
        total += abs(x[j]) >= threshold
    return total


@njit(**_OPTIONS)
def compact_at_least(x, threshold, out):
    """|x_j| for each |x_j| >= threshold, in order, into ``out``, which must be one longer
    than their count (:func:`count_at_least`): in a block that holds some, each |x_j| is
    written and kept by moving on, without a branch (at half the values passing, a
    branch per value ran 16x slower); blocks that hold none are skipped after their
    vector count. Returns the count."""
    count = 0
    n = x.size
    end = n - n % BLOCK
    for b in range(0, end, BLOCK):
        if block_hits(x, b, threshold):
            count = compact(x, b, b + BLOCK, threshold, out, count)
    return compact(x, end, n, threshold, out, count)


@njit(inline="always", **_OPTIONS)
def compact(x, lo, hi, threshold, out, count):
    """:func:`compact_at_least` of ``x[lo:hi]`` from ``out[count]``, one value at a time."""
    for j in range(lo, hi):
        magnitude = abs(x[j])
        out[count] = magnitude
        count += magnitude >= threshold
    return count
