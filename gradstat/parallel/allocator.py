"""glibc's allocator told to keep freed blocks of the sizes analyses churn through.

An analysis allocates and frees temporaries of one row or scope (0.1-100 MB) thousands
of times. glibc serves blocks above its mmap threshold (128 KiB at start) with a fresh
``mmap`` and returns them with ``munmap`` on free, so every temporary costs page faults
and zeroing by the kernel: measured on the demo capture's ``fit --dist all``, 19% of the
run was system time. Raising the mmap threshold to 64 MiB and the trim threshold to
256 MiB keeps such blocks in the heap for reuse (the same as starting Python with
``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=67108864:glibc.malloc.trim_threshold=268435456``).
Rows larger than 64 MiB are still mapped and unmapped. Elsewhere (not glibc) it does
nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util

#: mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 64 << 20
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
