"""CRC-32C checksums of what a capture stores (docs/format.md, "Integrity").

CRC-32C (Castagnoli, the checksum of iSCSI, ext4 and Btrfs; ``crc32c.crc32c``) because
CPUs compute it in hardware. Every checksum covers bytes as stored, little-endian:

* a block of ``columns`` consecutive values of a /grad or /sent row (schema 3; the last
  block of a row may be shorter), so that any column range is checked by reading the
  blocks that hold it;
* a row's bookkeeping: its step (int64), loss (float64) and, with /sent, sent bytes
  (float64), one after the other;
* the capture's identity and layer table, as canonical JSON (:func:`identity_checksum`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import numpy as np
from crc32c import crc32c


def _little_endian(values: np.ndarray) -> np.ndarray:
    """``values`` as contiguous little-endian bytes of their type (no copy if they are)."""
    data = np.ascontiguousarray(values)
    return data.astype(data.dtype.newbyteorder("<"), copy=False)


def row_checksum(row: np.ndarray, value: int = 0) -> int:
    """CRC-32C of values' bytes as stored (little-endian, their own dtype), continued
    from ``value`` (the CRC-32C of the bytes before them)."""
    return crc32c(_little_endian(row).reshape(-1).view(np.uint8), value)


def block_checksums(row: np.ndarray, columns: int) -> np.ndarray:
    """The CRC-32C of each block of ``columns`` values of a stored row (uint32)."""
    flat = _little_endian(row).reshape(-1)
    return np.array(
        [row_checksum(flat[at : at + columns]) for at in range(0, flat.size, columns)],
        dtype=np.uint32,
    )


def record_checksum(step: int, loss: float, sent_bytes: float | None = None) -> int:
    """CRC-32C of one row's bookkeeping: step (int64), loss (float64), sent bytes."""
    parts = [np.array([step], "<i8").tobytes(), np.array([loss], "<f8").tobytes()]
    if sent_bytes is not None:
        parts.append(np.array([sent_bytes], "<f8").tobytes())
    return crc32c(b"".join(parts))


def identity_checksum(
    run_id: str,
    world_size: int,
    ranks: Sequence[int],
    dtype: str,
    layers: Sequence[tuple[str, int, int, Sequence[int]]],
    extra: Mapping[str, object] | None = None,
) -> int:
    """CRC-32C of the capture's identity and layer table ``(name, offset, numel,
    shape)``, serialized as compact JSON with sorted keys."""
    document = {
        "run_id": run_id,
        "world_size": int(world_size),
        "recorded_ranks": [int(r) for r in ranks],
        "dtype": dtype,
        "layers": [[n, int(o), int(k), [int(s) for s in shape]] for n, o, k, shape in layers],
        **(extra or {}),
    }
    text = json.dumps(document, sort_keys=True, separators=(",", ":"))
    return crc32c(text.encode())
