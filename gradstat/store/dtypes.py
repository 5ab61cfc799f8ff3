"""How gradient rows are stored on disk, and how they come back as float32.

Three storage types (docs/format.md says when each is safe):

* ``float32``: exact.
* ``float16``: IEEE half; HDF5 and numpy know it. Magnitudes below ~6e-8 flush to zero
  and above 65504 overflow to infinity.
* ``bfloat16``: float32's exponent range with 8 bits of mantissa. HDF5 has no bfloat16
  type, so ``/grad`` holds the *bit patterns* of torch's bfloat16 rounding (round to
  nearest, ties to even) as ``uint16``, and carries the attribute
  ``gradstat_dtype = "bfloat16"``. A bfloat16 value is the upper half of the float32 with
  the same bits, so any reader converts with ``(bits.astype(np.uint32) << 16).view(np.float32)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from gradstat.errors import UsageError
from gradstat.store.schema import SUPPORTED_DTYPES

if TYPE_CHECKING:  # torch loads on first use: `gradstat info` and --help never need it
    import torch

#: Attribute of ``/grad`` naming the logical type of the stored values.
DTYPE_ATTR = "gradstat_dtype"
#: Logical storage type -> numpy type of the HDF5 dataset.
DISK_DTYPES = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
}


def check_dtype(dtype: str) -> str:
    """``dtype`` itself if it is a supported storage type, else a ``UsageError``."""
    if dtype not in DISK_DTYPES:
        raise UsageError(f"dtype must be one of {', '.join(SUPPORTED_DTYPES)}, got {dtype!r}")
    return dtype


def disk_dtype(dtype: str) -> np.dtype:
    """The numpy type of the ``/grad`` dataset for a storage type."""
    return DISK_DTYPES[check_dtype(dtype)]


def bytes_per_value(dtype: str) -> int:
    return disk_dtype(dtype).itemsize


def torch_dtype(dtype: str) -> torch.dtype:
    """The type of the hook's row buffers: the copy into them does the rounding."""
    import torch

    return getattr(torch, check_dtype(dtype))


def buffer_to_disk(buffer: torch.Tensor) -> np.ndarray:
    """A (CPU) row buffer as the array written to ``/grad``, without a copy."""
    import torch

    if buffer.dtype == torch.bfloat16:
        return buffer.view(torch.uint16).numpy()
    return buffer.numpy()


def float32_to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """Bit patterns of ``values`` rounded to bfloat16 by torch (ties to even)."""
    import torch

    tensor = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    return tensor.to(torch.bfloat16).view(torch.uint16).numpy()


def bfloat16_bits_to_float32(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float32 values of bfloat16 bit patterns: ``bits << 16`` read as float32 (exact)."""
    if out is None:
        out = np.empty(bits.shape, dtype=np.float32)
    np.left_shift(bits, 16, out=out.view(np.uint32), dtype=np.uint32)
    return out


def to_disk_values(row: np.ndarray, dtype: str) -> np.ndarray:
    """A float row as stored for ``dtype`` (bfloat16 bit patterns pass through)."""
    if dtype == "bfloat16" and row.dtype != np.uint16:
        return float32_to_bfloat16_bits(row)
    return row
