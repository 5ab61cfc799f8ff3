"""glibc's allocator told to keep freed blocks of the sizes analyses churn through.

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
"""

from __future__ import annotations

import ctypes
import ctypes.util

#: mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 256 << 20
TRIM_THRESHOLD = 256 << 20


def keep_freed_memory() -> bool:
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
