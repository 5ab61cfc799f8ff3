"""The compiled loops behind :mod:`gradstat.stats.histogram` (numba, no fast-math), each
the plain numpy reference of that module (:func:`~gradstat.stats.histogram.bin_sums_numpy`,
:func:`~gradstat.stats.histogram.gather_numpy`) done in one pass over the row. Compiled
once and cached next to this file (numba's ``cache=True``)."""

import numpy as np
from numba import njit

_OPTIONS = {"cache": True, "nogil": True, "boundscheck": False}
#: A bin's count sits above bit 40 of its packed word, its mantissa sum below.
_COUNT = 1 << 40
#: Most values one call of :func:`bin_sums` takes: a bin's count stays under 2^22 (its
#: packed word under 2^62) and its mantissa sum under 2^37 (inside its 40 bits).
MAX_VALUES = 1 << 22


@njit(**_OPTIONS)
def bin_sums(x, shift, counts, mantissas, squares):
    """Per signed bin ``j = bits(x) >> shift`` (the sign its top bit, zeros and NaN/Inf
    in bins of their own) of up to ``MAX_VALUES`` values: add the value's count,
    ``m = bits & (2^shift - 1)`` to ``mantissas[j]`` and m^2 to ``squares[j]``
    (integers: the float64 sums follow exactly, see the module). One integer add per
    value keeps count and m together (packed, unpacked at the end). Returns (values
    with |x| = 0, largest bit pattern of |x|, NaN/Inf included)."""
    bits = x.view(np.uint32)
    mask = (1 << shift) - 1
    packed = np.zeros(counts.size, np.int64)
    zeros = 0
    top = 0
    for i in range(x.size):
        b = bits[i]
        j = b >> shift
        m = np.int64(b & mask)
        packed[j] += _COUNT + m
        squares[j] += m * m
        a = b & 0x7FFFFFFF
        zeros += np.int64(a == 0)
        top = max(top, a)
    for j in range(packed.size):
        counts[j] += packed[j] >> 40
        mantissas[j] += packed[j] & (_COUNT - 1)
    return zeros, top


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
