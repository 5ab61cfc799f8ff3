"""Damaged rank files are errors naming file, learner and step, never data (issue 12.1)."""

from __future__ import annotations

import os
import shutil

import h5py
import numpy as np
import pytest
from crc32c import crc32c

from gradstat import open_capture
from gradstat.errors import DataError
from gradstat.store import RankFileWriter, layer_table, write_capture
from gradstat.store.schema import rank_file_name
from gradstat.store.verify import row_checksum, span_text
from tests.helpers import assert_clean_error, run_cli


def _copy(src, dst):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.log"))
    return dst


def _chunk_bytes(path, row):
    """Byte offset and size of the first chunk of ``row`` of ``/grad``."""
    with h5py.File(path, "r", swmr=True) as f:
        info = f["grad"].id.get_chunk_info_by_coord((row, 0))
        return info.byte_offset, info.size


@pytest.fixture
def wide_capture(tmp_path):
    """2 learners x 8 steps of 300,000 values: each row spans two chunks."""
    grads = np.random.default_rng(3).normal(size=(2, 8, 300_000)).astype(np.float32)
    path = write_capture(tmp_path / "wide", grads, layer_table([("w", (300_000,))]))
    return path, grads


@pytest.mark.parametrize("command", ["info", "fit", "similarity", "replay"])
def test_truncated_rank_file_is_an_error_naming_it(real_capture, tmp_path, capsys, command):
    """Regression: a rank file cut to half read as 'complete' with zero rows."""
    damaged = _copy(real_capture, tmp_path / "damaged")
    rank_file = damaged / rank_file_name(1)
    os.truncate(rank_file, rank_file.stat().st_size // 2)
    result = run_cli(capsys, command, damaged)
    assert_clean_error(result, code=1)
    assert f"{rank_file} (learner 1): steps " in result.stderr
    assert "damaged" in result.stderr
    if command == "info":
        assert "damaged: learner 1 steps" in result.stdout


def test_truncation_names_exactly_the_rows_past_the_end(wide_capture, tmp_path):
    path, _ = wide_capture
    damaged = _copy(path, tmp_path / "damaged")
    rank_file = damaged / rank_file_name(0)
    offset, size = _chunk_bytes(rank_file, 5)
    os.truncate(rank_file, offset + size - 1)  # the end of row 5's first chunk is gone
    with pytest.raises(DataError, match=r"rank-00000.h5 \(learner 0\): steps 5\.\.7 damaged"):
        open_capture(damaged)
    with open_capture(damaged, allow_damaged=True) as cap:
        assert cap.status == "damaged"
        assert [d.rows for d in cap.damage] == [(5, 6, 7)]


@pytest.mark.parametrize("damage", ["flip", "zeros"])
def test_corrupted_row_fails_its_checksum(wide_capture, tmp_path, capsys, damage):
    """A flipped bit, or a chunk zeroed by a file system after a crash (which a
    per-chunk Fletcher-32 would accept: zero data, zero checksum)."""
    path, grads = wide_capture
    damaged = _copy(path, tmp_path / "damaged")
    rank_file = damaged / rank_file_name(1)
    offset, size = _chunk_bytes(rank_file, 3)
    with open(rank_file, "r+b") as f:
        if damage == "flip":
            f.seek(offset + 1000)
            byte = f.read(1)[0]
            f.seek(offset + 1000)
            f.write(bytes([byte ^ 0x10]))
        else:
            f.seek(offset)
            f.write(bytes(size))
    with open_capture(damaged) as cap:  # the structure is intact
        np.testing.assert_array_equal(cap.read_step(2).numpy(), grads[:, 2])
        with pytest.raises(DataError, match=r"rank-00001.h5 \(learner 1\): step 3 is damaged"):
            cap.read_step(3)
    assert run_cli(capsys, "info", damaged).code == 0
    result = run_cli(capsys, "info", damaged, "--verify")
    assert_clean_error(result, code=1)
    assert "learner 1 steps 3" in result.stdout
    assert "rank-00001.h5 (learner 1): steps 3 damaged" in result.stderr
    assert_clean_error(run_cli(capsys, "fit", damaged), code=1)


def test_checksums_are_crc32c_of_the_stored_rows(wide_capture):
    """What docs/format.md tells users who verify without gradstat."""
    path, grads = wide_capture
    with h5py.File(path / rank_file_name(1), "r", swmr=True) as f:
        assert f["crc32c"].dtype == np.uint32
        for row in range(8):
            assert int(f["crc32c"][row]) == crc32c(f["grad"][row].tobytes())
    assert row_checksum(grads[1, 0].astype(">f4")) == crc32c(grads[1, 0].tobytes())
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value (RFC 3720)


def test_schema_1_is_read_and_verified_by_size_only(synthetic_capture, capsys):
    path, grads = synthetic_capture
    for file in path.glob("*.h5"):
        with h5py.File(file, "r+") as f:
            f.attrs["schema"] = 1
            if "crc32c" in f:
                del f["crc32c"]
    with open_capture(path) as cap:
        np.testing.assert_array_equal(cap.read_step(4).numpy(), grads[:, 4])
    result = run_cli(capsys, "info", path)
    assert result.code == 0, result
    assert "schema 1 has no row" in result.stdout.replace("\n", " ")


def test_other_schema_is_refused(synthetic_capture, capsys):
    path, _ = synthetic_capture
    with h5py.File(path / "capture.h5", "r+") as f:
        f.attrs["schema"] = 3
    result = run_cli(capsys, "info", path)
    assert_clean_error(result, code=1)
    assert "schema 3 is not supported" in result.stderr


def test_rank_file_writer_is_a_context_manager(tmp_path):
    path = tmp_path / rank_file_name(0)
    with pytest.raises(RuntimeError), RankFileWriter(path, 0, 4) as writer:
        writer.append(0, 1.0, np.arange(4, dtype=np.float32))
        raise RuntimeError("training failed")
    with h5py.File(path, "r") as f:  # plain read mode: the file was closed properly
        assert int(f.attrs["closed"]) == 1 and int(f.attrs["committed"]) == 1


def test_span_text():
    assert span_text([1, 2, 3, 7, 9, 10]) == "1..3, 7, 9..10"
    assert span_text([]) == ""
