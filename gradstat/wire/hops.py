"""One hop of a collective over many messages at once, in a wire format: what
:mod:`gradstat.wire.collectives` runs at every step of an algorithm.

``hops.hop(acc, src, index, own, mode)``: ``acc`` (rows x width float32, messages, one per
row) is updated in place with ``src[index[r], r]`` (``src``: learners x rows x width), as
``mode`` says (R: the wire format's rounding of a message, :meth:`Format.round`)::

    LOAD               a = R(b)         ROUND_ADD   a = R(a) + b
    ADD_ROUNDED        a = a + R(b)     ADD_ROUND   a = R(a + b)
    ADD_ROUNDED_ROUND  a = R(a + R(b))  ROUND       a = R(a)

Row ``own`` (-1: none) is the learner's own chunk: not rounded where it is received.

:class:`PlainHops` is the reference (torch operations on whole tensors, through the
format's :meth:`~gradstat.wire.formats.Format.round`); :class:`CompiledHops` does
each hop in one pass over memory (numba, :mod:`gradstat.wire._hop_loops`) for
the built-in formats, bit for bit the same (tests/test_collectives.py), 3-20x faster
(benchmarks/lowprec.py).
"""

from __future__ import annotations

import numpy as np
import torch

from gradstat.wire import formats
from gradstat.wire.formats import Format

LOAD, ROUND_ADD, ADD_ROUNDED, ADD_ROUNDED_ROUND, ADD_ROUND, ROUND = range(6)


class PlainHops:
    """Hops with torch operations and the format's ``round`` (the reference)."""

    def __init__(self, fmt: Format) -> None:
        self.fmt = fmt

    def hop(
        self, acc: torch.Tensor, src: torch.Tensor, index: torch.Tensor, own: int, mode: int
    ) -> None:
        rnd = self.fmt.round
        if mode == ROUND:
            acc.copy_(rnd(acc))
            return
        got = src[index, torch.arange(acc.shape[0])]
        if mode in (LOAD, ADD_ROUNDED, ADD_ROUNDED_ROUND):
            rounded = rnd(got)
            if own >= 0:
                rounded[own] = got[own]
            got = rounded
        if mode == LOAD:
            acc.copy_(got)
        elif mode == ROUND_ADD:
            acc.copy_(rnd(acc).add_(got))
        elif mode == ADD_ROUNDED:
            acc.add_(got)
        else:  # ADD_ROUNDED_ROUND, ADD_ROUND
            acc.copy_(rnd(acc + got))


def _loop_settings(fmt: Format) -> tuple[np.ndarray, np.ndarray] | None:
    """The compiled loop's integer and float32 settings for a built-in format (None for
    any other): scale kind, block, dropped mantissa bits, MX emax; smallest normal,
    subnormal magic number, largest element, overflow bound, largest finite."""
    from gradstat.wire import _hop_loops as loops

    inf = float("inf")
    if isinstance(fmt, formats.Cast):
        kind, group, emax, top, largest = loops.NO_SCALE, 0, 0, inf, inf
        info = torch.finfo(fmt.dtype)
        man_bits, emin = -int(np.log2(info.eps)), int(np.log2(info.smallest_normal))
        overflow = inf if fmt.dtype == torch.bfloat16 else float(info.max)
    elif isinstance(fmt, formats.ScaledFp8):
        info = torch.finfo(fmt.dtype)
        kind, group, emax, overflow = loops.MESSAGE_SCALE, 0, 0, inf
        man_bits, emin = -int(np.log2(info.eps)), int(np.log2(info.smallest_normal))
        top = largest = fmt.max_finite
    elif isinstance(fmt, formats.Mx):
        element = fmt.element
        kind, group, emax, overflow = loops.BLOCK_SCALE, 32, element.emax, inf
        man_bits, emin = element.man_bits, element.emin
        top = largest = element.max_normal
    else:
        return None
    drop = 23 - man_bits
    # bf16's subnormals are float32's: the bits alone round them (no subnormal branch)
    small = 0.0 if kind == loops.NO_SCALE and fmt.dtype == torch.bfloat16 else 2.0**emin
    ints = np.array([kind, group, drop, emax, np.float32(small).view(np.int32)], dtype=np.int64)
    floats = np.array([2.0 ** (emin - man_bits + 23), top, overflow, largest], dtype=np.float32)
    return ints, floats


class CompiledHops:
    """Hops in one pass over memory each (numba) for a built-in format."""

    def __init__(self, fmt: Format) -> None:
        settings = _loop_settings(fmt)
        if settings is None:
            raise ValueError(f"no compiled hops for the format {fmt!r}")
        self.fmt = fmt
        self.ints, self.floats = settings

    def hop(
        self, acc: torch.Tensor, src: torch.Tensor, index: torch.Tensor, own: int, mode: int
    ) -> None:
        from gradstat.wire._hop_loops import hop

        hop(acc.numpy(), src.numpy(), index.numpy(), own, mode, self.ints, self.floats)


def hops_for(fmt: Format, plain: bool = False) -> PlainHops | CompiledHops:
    """The compiled hops for a built-in format, the plain ones otherwise (or when
    ``plain``: the reference the tests and ``benchmarks/lowprec.py --plain`` run)."""
    if plain or _loop_settings(fmt) is None:
        return PlainHops(fmt)
    return CompiledHops(fmt)
