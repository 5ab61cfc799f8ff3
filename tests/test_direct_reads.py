"""Rows read straight from the file (gradstat.store.direct) against HDF5's own reads."""

from __future__ import annotations

import os
import signal

import numpy as np
import pandas as pd
import pytest

from gradstat import open_capture
from gradstat.errors import DataError
from gradstat.store import RankFileWriter, finalize_root, layer_table, write_capture, write_root
from gradstat.store import direct as direct_module
from gradstat.store import writer as writer_module
from gradstat.store.schema import MAX_CHUNK_BYTES, rank_file_name
from gradstat.store.verify import row_checksum

#: Values per row: three and a bit float32 chunks (an edge chunk), two bfloat16 chunks.
NUMEL = 3 * MAX_CHUNK_BYTES // 4 + 1237


def _grads(learners: int = 3, steps: int = 2) -> np.ndarray:
    rng = np.random.default_rng(11)
    return rng.standard_normal((learners, steps, NUMEL)).astype(np.float32)


def _hdf5_row(cap, learner: int, step: int, columns: slice = slice(None)) -> np.ndarray:
    """The row as HDF5 reads it (h5py slicing, no direct path), converted as stored."""
    dataset = cap._files[cap._position[learner]]["grad"]
    stored = dataset[cap._row_of[step], columns]
    if cap.dtype == "bfloat16":
        return (stored.astype(np.uint32) << 16).view(np.float32)
    return stored.astype(np.float32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_direct_reads_equal_hdf5_reads(tmp_path, dtype):
    """Whole rows and column ranges that start, end and cross inside chunks, bit for bit."""
    path = write_capture(tmp_path / dtype, _grads(), layer_table([("w", (NUMEL,))]), dtype=dtype)
    rng = np.random.default_rng(0)
    with open_capture(path) as cap:
        assert cap._dataset(0, "grad")[1] is not None  # the direct path is taken
        for step in cap.steps:
            for learner in cap.learners:
                got = cap.read_row(int(step), learner)
                assert np.array_equal(
                    got.view(np.uint32), _hdf5_row(cap, learner, int(step)).view(np.uint32)
                )
        chunk = cap._files[0]["grad"].chunks[1]
        edges = [(0, 1), (chunk - 1, chunk + 1), (chunk, 2 * chunk), (5, NUMEL), (NUMEL - 1, NUMEL)]
        edges += [tuple(sorted(rng.choice(NUMEL + 1, 2, replace=False))) for _ in range(20)]
        for start, stop in edges:
            columns = slice(int(start), int(stop))
            got = cap.read_row(1, 2, columns=columns)
            assert np.array_equal(got, _hdf5_row(cap, 2, 1, columns)), (start, stop)


def test_compressed_rows_are_left_to_hdf5(tmp_path):
    path = tmp_path / "gzip"
    layers = layer_table([("w", (NUMEL,))])
    path.mkdir()
    write_root(path, layers, 1, "float32", {})
    grads = _grads(learners=1)
    with RankFileWriter(path / rank_file_name(0), 0, NUMEL, compression="gzip") as writer:
        for step in range(grads.shape[1]):
            writer.append(step, 0.0, grads[0, step])
    finalize_root(path)
    with open_capture(path) as cap:
        assert cap._dataset(0, "grad")[1] is None
        assert np.array_equal(cap.read_row(1, 0), grads[0, 1])


def test_damaged_bytes_still_fail_their_checksum(tmp_path):
    """A flipped byte inside a chunk: the direct read sees it and the CRC-32C names it."""
    path = write_capture(tmp_path / "cap", _grads(), layer_table([("w", (NUMEL,))]))
    _flip_byte(path, learner=1, row=1, column=25)
    with open_capture(path) as cap:
        assert np.array_equal(cap.read_row(0, 1), _grads()[1, 0])
        with pytest.raises(DataError, match=r"learner 1\): step 1 is damaged"):
            cap.read_row(1, 1)
        (damage,) = cap.verify_rows()
        assert (damage.learner, damage.rows) == (1, (1,))


def test_direct_reads_open_no_descriptors(tmp_path):
    """They read through HDF5's own descriptor of each rank file, and nothing is left
    open after the capture closes."""
    path = write_capture(tmp_path / "cap", _grads(), layer_table([("w", (NUMEL,))]))
    before = len(os.listdir("/proc/self/fd"))
    with open_capture(path) as cap:
        opened = len(os.listdir("/proc/self/fd"))
        for learner in cap.learners:
            cap.read_row(0, learner)
            assert cap._dataset(cap._position[learner], "grad")[1] is not None
        assert len(os.listdir("/proc/self/fd")) == opened
    assert len(os.listdir("/proc/self/fd")) == before


@pytest.mark.parametrize("piece", [4096, 3 * 4096 + 4, 1 << 30])
def test_checksum_computed_while_reading_equals_the_row_checksum(tmp_path, monkeypatch, piece):
    """The CRC-32C advanced piece by piece in the helper thread, for pieces that split
    chunks unevenly, equals the checksum of the whole row and the one recorded."""
    monkeypatch.setattr(direct_module, "PIECE_BYTES", piece)
    path = write_capture(tmp_path / "cap", _grads(), layer_table([("w", (NUMEL,))]))
    with open_capture(path) as cap:
        _, direct = cap._dataset(0, "grad")
        out = np.empty(NUMEL, dtype=np.float32)
        for step in cap.steps:
            row = cap._row_of[int(step)]
            crc = direct.read_checksummed(row, 0, NUMEL, out)
            assert crc == row_checksum(_grads()[0, int(step)])
            half = direct.read_checksummed(row, 0, NUMEL // 2 + 3, out[: NUMEL // 2 + 3])
            rest = direct.read_checksummed(row, NUMEL // 2 + 3, NUMEL, out[NUMEL // 2 + 3 :], half)
            assert rest == crc
            assert crc == int(cap._checksums[0][cap._row_of[int(step)]])
            assert np.array_equal(out, _grads()[0, int(step)])
        assert cap.verify_rows() == []


def _flip_byte(path, learner: int, row: int, column: int) -> None:
    """Damage one byte of a stored value, behind HDF5's back."""
    with open_capture(path) as cap:
        width = cap._files[learner]["grad"].chunks[1]
        info = cap._files[learner]["grad"].id.get_chunk_info_by_coord(
            (row, column // width * width)
        )
    with open(path / rank_file_name(learner), "r+b") as f:
        f.seek(info.byte_offset + (column % width) * 4 + 1)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x10]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("direct", [True, False])
def test_column_blocks_read_in_order_are_checked(tmp_path, monkeypatch, dtype, direct):
    """A row read in column blocks from its first column on is checked against its
    CRC-32C when its last block arrives (by the direct path or HDF5's), whichever block
    holds the damage; blocks out of order are not checked (structure only, as before)."""
    if not direct:
        monkeypatch.setattr(direct_module.DirectRows, "usable", classmethod(lambda *a: None))
    path = write_capture(tmp_path / "cap", _grads(), layer_table([("w", (NUMEL,))]), dtype=dtype)
    _flip_byte(path, learner=2, row=1, column=NUMEL // 3)
    blocks = [(0, NUMEL // 4), (NUMEL // 4, NUMEL // 2), (NUMEL // 2, NUMEL)]
    with open_capture(path) as cap:
        for learner in (0, 1):  # intact rows, blocks interleaved across learners
            for step in (0, 1):
                for start, stop in blocks:
                    cap.read_row(step, learner, columns=slice(start, stop))
        for start, stop in blocks[:-1]:
            cap.read_row(1, 2, columns=slice(start, stop))
        with pytest.raises(DataError, match=r"learner 2\): step 1 is damaged"):
            cap.read_row(1, 2, columns=slice(*blocks[-1]))
        for start, stop in reversed(blocks):  # out of order: nothing to check against
            cap.read_row(1, 2, columns=slice(start, stop))
        assert cap._partial.keys() <= {(cap._position[2], 1)}


def test_a_block_analysis_of_a_damaged_row_fails_naming_it(tmp_path):
    """similarity in column blocks (a small --memory) no longer reads damage silently."""
    from gradstat.analysis.compute import Compute
    from gradstat.analysis.selection import Selection
    from gradstat.analysis.similarity import SimilarityParams, similarity

    path = write_capture(tmp_path / "cap", _grads(), layer_table([("w", (NUMEL,))]))
    _flip_byte(path, learner=1, row=0, column=NUMEL - 5)
    compute = Compute(device="cpu", jobs=1, memory=NUMEL * 4)  # blocks of NUMEL / 4
    assert compute.block_numel(NUMEL) < NUMEL
    with open_capture(path) as cap, pytest.raises(DataError, match=r"step 0 is damaged"):
        similarity(cap, Selection.of(cap), SimilarityParams(0.01), compute=compute)


def test_a_forked_child_reads_and_checks_rows(tmp_path):
    """After fork the parent's checksum thread is gone: the child must start its own
    instead of queueing pieces nobody checksums (it would wait forever)."""
    path = write_capture(tmp_path / "cap", _grads(), layer_table([("w", (NUMEL,))]))
    with open_capture(path) as cap:
        cap.read_row(0, 0)  # the parent's checksum thread is running
        reading, writing = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - runs in the child
            signal.alarm(20)
            ok = np.array_equal(cap.read_row(1, 2), _grads()[2, 1])
            os.write(writing, b"ok" if ok else b"wrong")
            os._exit(0)
        os.close(writing)
        answer = os.read(reading, 8)
        os.close(reading)
        _, status = os.waitpid(child, 0)
    assert answer == b"ok" and os.waitstatus_to_exitcode(status) == 0


def _runs_per_row(cap, learner: int, rows: int) -> list[int]:
    direct = cap._dataset(cap._position[learner], "grad")[1]
    return [len(direct._runs(row, 0, cap.numel)) for row in range(rows)]


@pytest.mark.parametrize("meta_block", [2048, None])
def test_every_row_lies_in_one_run_of_the_file(tmp_path, monkeypatch, meta_block):
    """HDF5 places its own small allocations (the chunk index) between a row's chunks
    unless metadata space is set aside in larger blocks (the writer's META_BLOCK_BYTES):
    with HDF5's 2 KiB, some of 40 rows are split; with the writer's, none."""
    if meta_block is not None:
        monkeypatch.setattr(writer_module, "META_BLOCK_BYTES", meta_block)
    grads = _grads(learners=2, steps=40)
    path = write_capture(tmp_path / "cap", grads, layer_table([("w", (NUMEL,))]))
    with open_capture(path) as cap:
        split = sum(n > 1 for learner in cap.learners for n in _runs_per_row(cap, learner, 40))
    assert (split > 0) == (meta_block is not None)


def test_views_equal_reads_and_are_checked(tmp_path):
    """A view of a whole row, or of its blocks in order, holds the row's values and is
    checked against its CRC-32C like a read: a flipped byte fails at the row's last
    block, naming the file, learner and step."""
    grads = _grads()
    path = write_capture(tmp_path / "cap", grads, layer_table([("w", (NUMEL,))]))
    _flip_byte(path, learner=2, row=1, column=NUMEL // 3)
    blocks = [(0, NUMEL // 4), (NUMEL // 4, NUMEL // 2), (NUMEL // 2, NUMEL)]
    with open_capture(path) as cap:
        for step in (0, 1):
            for learner in (0, 1):
                whole = cap.row_view(step, learner, slice(0, NUMEL))
                assert np.array_equal(whole, grads[learner, step])
                for start, stop in blocks:
                    view = cap.row_view(step, learner, slice(start, stop))
                    assert np.array_equal(view, grads[learner, step, start:stop])
        with pytest.raises(ValueError, match="contiguous"):  # as read_row: no strided views
            cap.row_view(0, 0, slice(0, NUMEL, 2))
        with pytest.raises(DataError, match=r"rank-00002.h5 \(learner 2\): step 1 is damaged"):
            cap.row_view(1, 2, slice(0, NUMEL))
        for start, stop in blocks[:-1]:
            cap.row_view(1, 2, slice(start, stop))
        with pytest.raises(DataError, match=r"learner 2\): step 1 is damaged"):
            cap.row_view(1, 2, slice(*blocks[-1]))


def test_a_view_never_writes_the_file(tmp_path):
    """Views are copy-on-write: writing into one changes neither the file nor a read,
    and once forgotten the view shows the file's values again."""
    grads = _grads()
    path = write_capture(tmp_path / "cap", grads, layer_table([("w", (NUMEL,))]))
    rank_file = path / rank_file_name(1)
    before = rank_file.read_bytes()
    with open_capture(path) as cap:
        view = cap.row_view(0, 1, slice(0, NUMEL))
        view[:] = 0.0
        assert np.array_equal(cap.read_row(0, 1), grads[1, 0])
        cap.forget_view(1, view)
        assert np.array_equal(view, grads[1, 0])
    assert rank_file.read_bytes() == before


def test_rows_that_cannot_be_seen_in_place_are_read(tmp_path, monkeypatch):
    """bfloat16 rows (converted), and float32 rows whose columns are not one run of the
    file, have no view: the analyses read them into a buffer, with the same results."""
    from gradstat.analysis.compute import Compute
    from gradstat.analysis.selection import Selection
    from gradstat.analysis.similarity import SimilarityParams, similarity

    layers = layer_table([("w", (NUMEL,))])
    bf16 = write_capture(tmp_path / "bf16", _grads(), layers, dtype="bfloat16")
    with open_capture(bf16) as cap:
        assert cap.row_view(0, 0, slice(0, NUMEL)) is None
    path = write_capture(tmp_path / "cap", _grads(), layers)
    compute = Compute(device="cpu", jobs=1)
    with open_capture(path) as cap:
        seen = similarity(cap, Selection.of(cap), SimilarityParams(0.01), compute=compute)
    runs = direct_module.DirectRows._runs

    def split(self, row, start, stop):  # every row in two runs, as HDF5 2 KiB blocks may
        found = runs(self, row, start, stop)
        middle = (found[0][1] + found[0][2]) // 2
        first = (found[0][0], found[0][1], middle)
        return [first, (found[0][0] + (middle - found[0][1]) * 4, middle, found[0][2])]

    monkeypatch.setattr(direct_module.DirectRows, "_runs", split)
    with open_capture(path) as cap:
        assert cap.row_view(0, 0, slice(0, NUMEL)) is None
        assert np.array_equal(cap.read_row(0, 0), _grads()[0, 0])
        read = similarity(cap, Selection.of(cap), SimilarityParams(0.01), compute=compute)
    pd.testing.assert_frame_equal(seen.pairs, read.pairs)
    pd.testing.assert_frame_equal(seen.steps, read.steps)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="Linux's RssFile")
def test_forgotten_views_are_not_resident(tmp_path):
    """A view's pages count as the process's resident memory once touched; forgetting
    the view gives them back (they stay in the page cache)."""
    rows = _grads(learners=1, steps=4)
    path = write_capture(tmp_path / "cap", rows, layer_table([("w", (NUMEL,))]))

    def resident_file_bytes() -> int:
        with open("/proc/self/status") as status:
            line = next(x for x in status if x.startswith("RssFile:"))
        return int(line.split()[1]) * 1024

    with open_capture(path) as cap:
        views = [cap.row_view(step, 0, slice(0, NUMEL)) for step in range(4)]  # checked
        touched = resident_file_bytes()
        for view in views:
            cap.forget_view(0, view)
        assert touched - resident_file_bytes() >= 3 * NUMEL * 4
        assert np.array_equal(views[2], rows[0, 2])
