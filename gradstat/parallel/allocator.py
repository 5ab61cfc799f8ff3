"""The memory allocators of an analysis process: glibc told to keep freed blocks of the
sizes analyses churn through, and numpy told not to ask for transparent huge pages.

An analysis allocates and frees temporaries of one row or scope (0.1-1000 MB) thousands
of times. glibc serves blocks above its mmap threshold (128 KiB at start) with a fresh
``mmap`` and returns them with ``munmap`` on free, so every temporary costs page faults
and zeroing by the kernel: measured on the demo capture's ``fit --dist all``, 19% of the
run was system time, and a fresh 128 MB tensor cost 60 ms of faults against 7 ms for a
reused block. Raising the mmap and trim thresholds to 256 MiB keeps such blocks in the
heap for reuse (the same as ``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=268435456:``
``glibc.malloc.trim_threshold=268435456``): rows of up to 64M float32 values. Measured
on 4 learners x 32M values: replay of top-k 5.75 s -> 2.94 s, fit of a row 2.65 s ->
1.63 s, peak RSS +22% and +6%. Larger blocks are still mapped and unmapped: with a 1 GiB
threshold a replay of 16 learners x 128M values peaked at 14.8 GB of retained blocks,
where its live rows are a few GB. Elsewhere (not glibc) it does nothing.

numpy advises the kernel to back every array of 4 MB or more with transparent huge pages
(``madvise``). Where the kernel compacts memory to find them on the fault (Linux's
``defrag`` setting ``madvise``, the default) and the page cache holds the capture just
read, a fault can stall: similarity of 4 x 32M values took 0.78-1.34 s a run (median
1.10 s of 8) with the advice and 0.82-0.90 s (median 0.88 s) without it.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np

#: mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 256 << 20
TRIM_THRESHOLD = 256 << 20


def tune_allocators() -> bool:
    """Apply both to this process (see the module docstring); False where the C library
    has no mallopt."""
    _no_huge_page_advice()
    return _keep_freed_memory()


def _no_huge_page_advice() -> None:
    """numpy's huge-page advice off (the same as ``NUMPY_MADVISE_HUGEPAGE=0`` before
    numpy is imported); a numpy without the switch keeps its default."""
    switch = getattr(getattr(np, "_core", None), "multiarray", None)
    set_advice = getattr(switch, "_set_madvise_hugepage", None)
    if set_advice is not None:
        set_advice(False)


def _keep_freed_memory() -> bool:
    """Apply the thresholds to this process; False where the C library has no mallopt."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
