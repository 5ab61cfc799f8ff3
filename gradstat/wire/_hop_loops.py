"""The compiled loop behind :class:`gradstat.wire.hops.CompiledHops` (numba,
no fast-math: each float32 operation is the one written, in the order written, so the
results equal the torch reference, :class:`~gradstat.wire.hops.PlainHops`,
bit for bit; tests/test_collectives.py compares them).

One hop of a collective over a set of messages (rows) in one pass: read what a learner
holds and what it receives, round either or both or the sum to the wire format, write
the result. The wire format's rounding of one value ``v`` with its message's (or MX
block's) scale ``s`` is ``round(clamp(v / s, -top, top)) * s``; ``round`` keeps
``23 - drop`` mantissa bits, ties to even (an integer add-and-mask on the float32 bits;
a carry moves into the exponent), below ``small`` (the format's smallest normal) on the
subnormal spacing (adding and subtracting ``magic`` in float32). Every constant is
float32, so no operation widens to float64. Constants and codes: docs/lowprecision.md.
Compiled once and cached next to this file (``cache=True``).
"""

import numpy as np
from numba import njit

_OPTIONS = {"cache": True, "nogil": True, "boundscheck": False}

#: How a format scales a message: not at all (casts), one scale per message
#: (``amax / max_finite``), one power of two per block of ``group`` values (MX).
NO_SCALE, MESSAGE_SCALE, BLOCK_SCALE = 0, 1, 2

#: What a hop does with ``a`` (held) and ``b`` (received); R is the wire's rounding:
#: a = R(b) | a = R(a) + b | a = a + R(b) | a = R(a + R(b)) | a = R(a + b) | a = R(a)
LOAD, ROUND_ADD, ADD_ROUNDED, ADD_ROUNDED_ROUND, ADD_ROUND, ROUND = range(6)


@njit(inline="always", **_OPTIONS)
def _float(bits):
    """The float32 whose bit pattern is the integer ``bits`` (its low 32 bits)."""
    return np.int32(bits).view(np.float32)


@njit(inline="always", **_OPTIONS)
def _round(v, drop, small, magic, overflow):
    """``v`` (float32) to nearest, ties to even, with ``23 - drop`` mantissa bits (``drop``
    0: unchanged); below ``small`` (bit pattern of the smallest normal) on the subnormal
    spacing; a magnitude above ``overflow`` (fp16's 65504) becomes infinite."""
    if drop == 0:
        return v
    bits = np.int64(np.float32(v).view(np.int32))
    sign = bits & -2147483648  # bit 31, sign-extended
    magnitude = bits & 0x7FFFFFFF
    if magnitude < small:
        rounded = np.int64(np.float32((_float(magnitude) + magic) - magic).view(np.int32))
    else:
        lsb = (magnitude >> drop) & 1
        rounded = (magnitude + ((1 << (drop - 1)) - 1) + lsb) & ~((1 << drop) - 1)
    out = _float(rounded | sign)
    return _float(0x7F800000 | sign) if abs(out) > overflow else out


@njit(inline="always", **_OPTIONS)
def _power_of_two(exponent):
    """``2^exponent`` (float32, -127 <= exponent <= 127) from its bits."""
    return _float((exponent + 127) << 23) if exponent >= -126 else _float(0x00400000)


@njit(inline="always", **_OPTIONS)
def _scale(x, kind, max_finite, emax):
    """The scale of the message (or block) ``x``: 1 (casts), ``amax / max_finite`` (1 for
    zeros), or ``2^(floor(log2 amax) - emax)`` clamped to ``2^-127 .. 2^127`` (MX)."""
    one = np.float32(1.0)
    if kind == NO_SCALE:
        return one
    amax = np.float32(0.0)
    for j in range(x.size):
        amax = max(amax, abs(x[j]))
    if kind == MESSAGE_SCALE:
        return amax / max_finite if amax > 0 else one
    field = (np.float32(amax).view(np.int32) >> 23) & 0xFF
    return _power_of_two(min(max(field - 127 - emax, -127), 127))


@njit(inline="always", **_OPTIONS)
def _wire(v, s, f):
    """``v`` as the wire carries it in a message (or block) of scale ``s``."""
    drop, small, magic, top, overflow = f
    q = v / s
    q = q if q < top else top  # a clamp written as selects (min/max: 1.7x slower)
    q = q if q > -top else -top
    return _round(q, drop, small, magic, overflow) * s


@njit(inline="always", **_OPTIONS)
def _cast(v, f):
    """``v`` as a cast format carries it (no scale)."""
    drop, small, magic, _, overflow = f
    return _round(v, drop, small, magic, overflow)


# The loops below run over whole views from index 0: a loop from a start index to a
# stop index is not vectorized by LLVM here (3.5x slower, measured).


@njit(inline="always", **_OPTIONS)
def _rounded(a, s, f, scaled):
    """a = R(a)."""
    if scaled:
        for j in range(a.size):
            a[j] = _wire(a[j], s, f)
    else:
        for j in range(a.size):
            a[j] = _cast(a[j], f)


@njit(inline="always", **_OPTIONS)
def _rounded_plus(a, b, s, f, scaled):
    """a = R(a) + b."""
    if scaled:
        for j in range(a.size):
            a[j] = _wire(a[j], s, f) + b[j]
    else:
        for j in range(a.size):
            a[j] = _cast(a[j], f) + b[j]


@njit(inline="always", **_OPTIONS)
def _plus_rounded(a, b, s, f, scaled, load):
    """a = R(b) (``load``) or a = a + R(b)."""
    if scaled and load:
        for j in range(a.size):
            a[j] = _wire(b[j], s, f)
    elif scaled:
        for j in range(a.size):
            a[j] = a[j] + _wire(b[j], s, f)
    elif load:
        for j in range(a.size):
            a[j] = _cast(b[j], f)
    else:
        for j in range(a.size):
            a[j] = a[j] + _cast(b[j], f)


@njit(**_OPTIONS)
def hop(acc, src, src_index, own, mode, fmt, floats):
    """One hop over the messages ``acc`` (rows x width float32, written in place): row
    ``r`` meets ``src[src_index[r], r]`` as ``mode`` says (:data:`LOAD` ...); row ``own``
    (-1: none) is the learner's own chunk and is not rounded where it is received.

    ``fmt`` (int64): scale kind, block width, ``drop``, MX ``emax``, the bit pattern of
    the smallest normal; ``floats`` (float32): ``magic``, ``top`` (largest element
    magnitude after scaling), ``overflow`` (casts: above it infinity), ``max_finite``
    (of the message-scale formats).
    """
    kind, group, emax = fmt[0], fmt[1], fmt[3]
    f = (fmt[2], fmt[4], floats[0], floats[1], floats[2])
    max_finite = floats[3]
    scaled = kind != NO_SCALE
    rows, width = acc.shape
    step = group if kind == BLOCK_SCALE else max(width, 1)
    for r in range(rows):
        got = r != own and mode in (LOAD, ADD_ROUNDED, ADD_ROUNDED_ROUND)
        for start in range(0, width, step):
            a = acc[r, start : start + step]
            b = src[src_index[r], r, start : start + step]
            if mode == ROUND:
                _rounded(a, _scale(a, kind, max_finite, emax), f, scaled)
            elif mode == ROUND_ADD:
                _rounded_plus(a, b, _scale(a, kind, max_finite, emax), f, scaled)
            elif got:
                _plus_rounded(a, b, _scale(b, kind, max_finite, emax), f, scaled, mode == LOAD)
            elif mode == LOAD:
                a[:] = b
            else:  # ADD_ROUNDED of the own chunk, ADD_ROUND
                for j in range(a.size):
                    a[j] = a[j] + b[j]
            if mode in (ADD_ROUNDED_ROUND, ADD_ROUND):
                _rounded(a, _scale(a, kind, max_finite, emax), f, scaled)
