"""glibc's allocator told to keep freed blocks of the sizes analyses churn through.

An analysis allocates and frees temporaries of one row or scope (0.1-1000 MB) thousands
of times. glibc serves blocks above its mmap threshold (128 KiB at start) with a fresh
``mmap`` and returns them with ``munmap`` on free, so every temporary costs page faults
and zeroing by the kernel: measured on the demo capture's ``fit --dist all``, 19% of the
run was system time, and on a 32M-value row a fresh 128 MB tensor cost 60 ms of faults
against 7 ms for a reused block. Raising the mmap threshold and the trim threshold to
1 GiB keeps such blocks in the heap for reuse (the same as starting Python with
``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=1073741824``):
rows of up to 256M float32 values. The price: memory freed below the top of the heap
stays with the process until it exits. Elsewhere (not glibc) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util

#: mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30
TRIM_THRESHOLD = 1 << 30


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
