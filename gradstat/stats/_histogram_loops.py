"""The compiled loops behind :mod:`gradstat.stats.histogram` (numba, no fast-math), each
the plain numpy reference of that module (:func:`~gradstat.stats.histogram.bin_sums_numpy`,
:func:`~gradstat.stats.histogram.bucket_numpy`) done in one pass over the row. Compiled
once and cached next to this file (numba's ``cache=True``)."""

import numpy as np
from numba import njit

_OPTIONS = {"cache": True, "nogil": True, "boundscheck": False}


@njit(**_OPTIONS)
def bin_sums(x, shift, acc):
    """Add each finite non-zero x to its bin ``bits(|x|) >> shift``: row ``acc[bin]`` (one
    cache line of float64) takes the count, the sum and the sum of squares of |x| and the
    signed sum (per bin, so no addition waits on the one before: a single running sum
    is a chain of dependent additions as long as the row). Returns (zeros, NaN/Inf
    values, largest bit pattern)."""
    bits = x.view(np.uint32)
    zeros = 0
    nonfinite = 0
    top = 0
    for i in range(x.size):
        b = bits[i] & 0x7FFFFFFF
        if b == 0:
            zeros += 1
            continue
        if b >= 0x7F800000:
            nonfinite += 1
            continue
        v = np.float64(x[i])
        a = abs(v)
        j = b >> shift
        acc[j, 0] += 1.0
        acc[j, 1] += a
        acc[j, 2] += a * a
        acc[j, 3] += v
        top = max(top, b)
    return zeros, nonfinite, top


@njit(**_OPTIONS)
def bucket(x, shift, floor, starts, out):
    """Write each finite non-zero |x| whose bin is ``floor`` or above into ``out`` at its
    bin's cursor (``starts[1 + bin - floor]``, advanced per value): the values grouped by
    bin, ascending, each bin's in the row's order (a stable counting sort). Without a
    branch: every other value goes to slot 0, whose cursor points at ``out``'s last
    element, a scratch place that never advances (half the row passes: a branch on it
    mispredicted every other value, 3x the time)."""
    bits = x.view(np.uint32)
    cursor = starts.copy()
    for i in range(x.size):
        b = bits[i] & 0x7FFFFFFF
        k = (b >> shift) - floor + 1
        keep = (k > 0) & (b != 0) & (b < 0x7F800000)
        k = k if keep else 0
        out[cursor[k]] = abs(x[i])
        cursor[k] += 1 if keep else 0


@njit(**_OPTIONS)
def gather(x, shift, slot, starts, out):
    """Write each non-zero |x| whose bin has a ``slot`` (>= 0) into ``out`` at that slot's
    cursor (``starts[slot]``, advanced per value): the chosen bins' values, grouped."""
    bits = x.view(np.uint32)
    cursor = starts.copy()
    for i in range(x.size):
        b = bits[i] & 0x7FFFFFFF
        if b == 0 or b >= 0x7F800000:
            continue
        s = slot[b >> shift]
        if s >= 0:
            out[cursor[s]] = abs(x[i])
            cursor[s] += 1
