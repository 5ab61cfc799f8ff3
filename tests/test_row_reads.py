"""Checked reads of any column range (gradstat.store.rows) against plain h5py reads."""

from __future__ import annotations

import os
import shutil

import h5py
import numpy as np
import pytest
from crc32c import crc32c

from gradstat import open_capture
from gradstat.errors import DataError
from gradstat.store import layer_table, write_capture
from gradstat.store.schema import MAX_CHUNK_BYTES, rank_file_name

#: Values per row: three and a bit float32 chunks (an edge chunk), two bfloat16 chunks.
NUMEL = 3 * MAX_CHUNK_BYTES // 4 + 1237


def _grads(learners: int = 3, steps: int = 2) -> np.ndarray:
    rng = np.random.default_rng(11)
    return rng.standard_normal((learners, steps, NUMEL)).astype(np.float32)


def _hdf5_row(path, learner: int, row: int, columns: slice = slice(None)) -> np.ndarray:
    """The row as plain h5py reads it, converted as stored: the reference."""
    with h5py.File(path / rank_file_name(learner), "r") as f:
        stored = f["grad"][row, columns]
    if stored.dtype == np.uint16:
        return (stored.astype(np.uint32) << 16).view(np.float32)
    return stored.astype(np.float32)


def _edges(chunk: int, rng) -> list[tuple[int, int]]:
    edges = [(0, 1), (chunk - 1, chunk + 1), (chunk, 2 * chunk), (5, NUMEL), (NUMEL - 1, NUMEL)]
    edges += [(chunk + 3, chunk + 9), (0, NUMEL)]
    return edges + [tuple(sorted(rng.choice(NUMEL + 1, 2, replace=False))) for _ in range(12)]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_reads_equal_plain_hdf5_reads(tmp_path, dtype):
    """Whole rows and column ranges that start, end and cross inside chunks, bit for bit."""
    grads = _grads()
    path = write_capture(tmp_path / dtype, grads, layer_table([("w", (NUMEL,))]), dtype=dtype)
    with open_capture(path) as cap:
        for step in cap.steps:
            for learner in cap.learners:
                got = cap.read_row(int(step), learner)
                assert np.array_equal(got, _hdf5_row(path, learner, int(step)))
        chunk = cap._files[0]["grad"].chunks[1]
        for start, stop in _edges(chunk, np.random.default_rng(0)):
            columns = slice(int(start), int(stop))
            got = cap.read_row(1, 2, columns=columns)
            assert np.array_equal(got, _hdf5_row(path, 2, 1, columns)), (start, stop)


def _flip(path, learner: int, row: int, chunk: int, at: int = 100) -> None:
    """Flip one bit of value ``at`` of chunk ``chunk`` of a row of ``/grad``."""
    file = path / rank_file_name(learner)
    with h5py.File(file, "r") as f:
        width = f["grad"].chunks[1]
        info = f["grad"].id.get_chunk_info_by_coord((row, chunk * width))
    with open(file, "r+b") as f:
        f.seek(info.byte_offset + 4 * at + 2)
        byte = f.read(1)[0]
        f.seek(info.byte_offset + 4 * at + 2)
        f.write(bytes([byte ^ 0x40]))


def test_any_column_range_of_a_damaged_row_is_checked(tmp_path):
    """Regression (issue 30.1): a read that did not start at column 0 (a --scope regex)
    was not checked. Now a range is checked by the blocks that hold it: ranges inside the
    damaged chunk fail, the others read."""
    grads = _grads(2, 3)
    path = write_capture(tmp_path / "cap", grads, layer_table([("w", (NUMEL,))]))
    _flip(path, 1, 2, chunk=1)
    with open_capture(path) as cap:
        width = cap._files[0]["grad"].chunks[1]
        for start, stop in [(width + 50, width + 200), (width + 100, width + 101), (3, NUMEL)]:
            with pytest.raises(DataError, match=r"rank-00001.h5 \(learner 1\): step 2 is damaged"):
                cap.read_row(2, 1, columns=slice(start, stop))
        ok = cap.read_row(2, 1, columns=slice(5, width - 5))  # chunk 0 is intact
        assert np.array_equal(ok, grads[1, 2, 5 : width - 5])
        ok = cap.read_row(2, 1, columns=slice(2 * width + 1, NUMEL))
        assert np.array_equal(ok, grads[1, 2, 2 * width + 1 :])


def test_a_file_cut_while_it_is_read_is_an_error_not_sigbus(tmp_path):
    """Regression (issue 30.8): rows were read through a mapping of the file, and a file
    truncated under it ended the process with SIGBUS. Nothing is mapped now."""
    path = write_capture(tmp_path / "cap", _grads(2, 3), layer_table([("w", (NUMEL,))]))
    with open_capture(path) as cap:
        cap.read_row(0, 1)
        os.truncate(path / rank_file_name(1), (path / rank_file_name(1)).stat().st_size // 3)
        with pytest.raises(DataError, match=r"rank-00001.h5 \(learner 1\): step 2 is damaged"):
            cap.read_row(2, 1)


def test_schema_2_rows_are_checked_whole_in_any_column_range(tmp_path):
    """Schema 2 has one CRC-32C per row: a range is checked by reading its whole row."""
    grads = _grads(1, 2)
    path = write_capture(tmp_path / "cap", grads, layer_table([("w", (NUMEL,))]))
    old = tmp_path / "old"
    shutil.copytree(path, old)
    with h5py.File(old / rank_file_name(0), "r+") as f:
        f["crc32c"] = np.array([crc32c(f["grad"][r].tobytes()) for r in range(2)], np.uint32)
        del f["grad_crc32c"], f["record_crc32c"]
        f.attrs["schema"] = 2
    with h5py.File(old / "capture.h5", "r+") as f:
        f.attrs["schema"] = 2
    _flip(old, 0, 1, chunk=2)
    with pytest.warns(UserWarning, match="schema 2"), open_capture(old) as cap:
        assert np.array_equal(cap.read_row(0, 0, columns=slice(9, 99)), grads[0, 0, 9:99])
        with pytest.raises(DataError, match="step 1 is damaged"):
            cap.read_row(1, 0, columns=slice(9, 99))  # far from the flipped value
