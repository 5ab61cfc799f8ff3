"""The compiled loops behind :mod:`gradstat.stats.histogram` (numba, no fast-math), each
the plain numpy reference of that module (:func:`~gradstat.stats.histogram.bin_sums_numpy`,
:func:`~gradstat.stats.histogram.gather_numpy`) done in one pass over the row. Compiled
once and cached next to this file (numba's ``cache=True``)."""

import numpy as np
from numba import njit

_OPTIONS = {"cache": True, "nogil": True, "boundscheck": False}


@njit(**_OPTIONS)
def bin_sums(x, shift, counts, sums, squares):
    """Add each finite non-zero |x| to its bin ``bits(|x|) >> shift`` (count, float64 sum
    and sum of squares); returns (zeros, NaN/Inf values, float64 sum of the finite x,
    largest bit pattern)."""
    bits = x.view(np.uint32)
    zeros = 0
    nonfinite = 0
    signed = 0.0
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
        signed += v
        a = abs(v)
        j = b >> shift
        counts[j] += 1
        sums[j] += a
        squares[j] += a * a
        if b > top:
            top = b
    return zeros, nonfinite, signed, top


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
