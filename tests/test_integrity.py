"""Damaged rank files are errors naming file, learner and step, never data (issue 12.1)."""

from __future__ import annotations

import os
import shutil

import h5py
import numpy as np
import pytest
from crc32c import crc32c

from gradstat import open_capture
from gradstat.errors import DataError, GradstatWarning
from gradstat.store import RankFileWriter, finalize_root, layer_table, write_capture, write_root
from gradstat.store.checksums import row_checksum
from gradstat.store.schema import rank_file_name
from gradstat.store.verify import span_text
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
    result = run_cli(capsys, "info", damaged)
    assert result.code == 0 and "--verify" not in result.stdout
    result = run_cli(capsys, "info", damaged, "--verify")
    assert_clean_error(result, code=1)
    # one step: "step 3", not "steps 3" (issue 39); --verify says what it read
    assert "learner 1 step 3" in result.stdout
    assert "rank-00001.h5 (learner 1): step 3 damaged" in result.stderr
    rows = len(grads) * grads.shape[1]
    assert f"--verify: read {rows} rows of {len(grads)} learners" in result.stdout
    assert "1 row failed" in result.stdout
    assert_clean_error(run_cli(capsys, "fit", damaged), code=1)


def test_checksums_are_crc32c_of_the_stored_rows(wide_capture):
    """What docs/format.md tells users who verify without gradstat."""
    path, grads = wide_capture
    with h5py.File(path / rank_file_name(1), "r") as f:
        sums, columns = f["grad_crc32c"], int(f["grad_crc32c"].attrs["columns"])
        assert sums.dtype == np.uint32 and sums.shape == (8, 2) and columns == 150_000
        for row in range(8):
            for block in range(2):
                values = f["grad"][row, block * columns : (block + 1) * columns]
                assert int(sums[row, block]) == crc32c(values.tobytes())
    assert row_checksum(grads[1, 0].astype(">f4")) == crc32c(grads[1, 0].tobytes())
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value (RFC 3720)


def _as_schema_1(path) -> None:
    """Turn every file of the capture at ``path`` into schema 1: no checksums."""
    for file in path.glob("*.h5"):
        with h5py.File(file, "r+") as f:
            f.attrs["schema"] = 1
            for name in ("grad_crc32c", "record_crc32c"):
                if name in f:
                    del f[name]


def test_schema_1_is_read_and_verified_by_size_only(synthetic_capture, capsys):
    path, grads = synthetic_capture
    _as_schema_1(path)
    with pytest.warns(GradstatWarning, match="schema 1: no part of it is checksummed"):
        cap = open_capture(path)
    with cap:
        np.testing.assert_array_equal(cap.read_step(4).numpy(), grads[:, 4])
    result = run_cli(capsys, "info", path)
    assert result.code == 0, result
    assert "schema 1 has no row" in result.stdout.replace("\n", " ")


def test_other_schema_is_refused(synthetic_capture, capsys):
    path, _ = synthetic_capture
    with h5py.File(path / "capture.h5", "r+") as f:
        f.attrs["schema"] = 4
    result = run_cli(capsys, "info", path)
    assert_clean_error(result, code=1)
    assert "schema 4 is not supported" in result.stderr


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


# --- issue 30: never read damaged or mismatched data as data -----------------------------


def _edit(path, name, edit):
    """Open ``path/name`` in r+ mode and apply ``edit(f)``."""
    with h5py.File(path / name, "r+") as f:
        edit(f)


def _sent_capture(path, steps=3, numel=300_000):
    """2 learners with /sent rows (as a compression hook writes them)."""
    rng = np.random.default_rng(5)
    grads = rng.normal(size=(2, steps, numel)).astype(np.float32)
    sent = (grads * (rng.random(grads.shape) < 0.01)).astype(np.float32)
    path.mkdir()
    write_root(path, layer_table([("w", (numel,))]), 2, "float32", {}, run_id="s" * 32)
    for r in range(2):
        with RankFileWriter(path / rank_file_name(r), r, numel, sent=True, run_id="s" * 32) as w:
            for s in range(steps):
                w.append(s, 1.0 / (s + 1), grads[r, s], sent[r, s], 123.0)
    finalize_root(path)
    return path, grads, sent


def test_a_scope_read_of_a_damaged_layer_is_an_error(synthetic_capture, tmp_path, capsys):
    """Regression (issue 30.1): `similarity --scope fc.weight` read a flipped row with
    exit 0 (the CRC was skipped for reads not starting at column 0)."""
    path, _ = synthetic_capture
    damaged = _copy(path, tmp_path / "damaged")
    rank_file = damaged / rank_file_name(1)
    offset, _ = _chunk_bytes(rank_file, 3)
    with open(rank_file, "r+b") as f:  # a value of fc.weight (columns 80..579)
        f.seek(offset + 4 * 300 + 3)
        byte = f.read(1)[0]
        f.seek(offset + 4 * 300 + 3)
        f.write(bytes([byte ^ 0x40]))
    for command in ("similarity", "buildup", "overlap"):
        result = run_cli(capsys, command, damaged, "--scope", "fc.weight", "--ratios", "0.01")
        assert_clean_error(result, code=1)
        assert f"{rank_file} (learner 1): step 3 is damaged" in result.stderr


def test_sent_rows_and_losses_are_checked(tmp_path, capsys):
    """Regression (issue 30.2): a flipped /sent value and a zeroed /loss read as data."""
    path, grads, sent = _sent_capture(tmp_path / "sent")
    with open_capture(path) as cap:
        np.testing.assert_array_equal(cap.read_step(1, dataset="sent").numpy(), sent[:, 1])
    flipped = _copy(path, tmp_path / "flipped")
    with h5py.File(flipped / rank_file_name(0), "r") as f:
        info = f["sent"].id.get_chunk_info_by_coord((2, 0))
    with open(flipped / rank_file_name(0), "r+b") as f:
        f.seek(info.byte_offset + 4 * 77 + 3)
        byte = f.read(1)[0]
        f.seek(info.byte_offset + 4 * 77 + 3)
        f.write(bytes([byte ^ 0x20]))
    with open_capture(flipped) as cap:
        np.testing.assert_array_equal(cap.read_step(2).numpy(), grads[:, 2])  # /grad intact
        with pytest.raises(DataError, match=r"\(learner 0\): step 2 of /sent is damaged"):
            cap.read_step(2, dataset="sent")
    result = run_cli(capsys, "info", flipped, "--verify")
    assert_clean_error(result, code=1)
    assert "rank-00000.h5 (learner 0): step 2 damaged" in result.stderr
    zeroed = _copy(path, tmp_path / "zeroed")
    _edit(zeroed, rank_file_name(1), lambda f: f["loss"].__setitem__(1, 0.0))
    with pytest.raises(DataError, match=r"rank-00001.h5 \(learner 1\): row 1 damaged: their"):
        open_capture(zeroed)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda g: (g["offset"].__setitem__(1, 88), g["numel"].__setitem__(1, 0)), "layer table"),
        (lambda g: g["offset"].__setitem__(2, 81), "layer table is damaged at 'fc.weight'"),
        (lambda g: g["name"].__setitem__(0, "fc.weight"), "names a layer twice"),
        (lambda g: g["name"].__setitem__(0, "conv.wEight"), "does not match its CRC-32C"),
    ],
)
def test_the_layer_table_is_validated(synthetic_capture, capsys, edit, message):
    """Regression (issue 30.3): a layer table with a gap or overlap (offset += 16,
    numel -= 16) or a flipped byte read as data."""
    path, _ = synthetic_capture
    _edit(path, "capture.h5", lambda f: edit(f["layers"]))
    result = run_cli(capsys, "similarity", path)
    assert_clean_error(result, code=1)
    assert f"{path / 'capture.h5'}: " in result.stderr and message in result.stderr


def test_shifted_layers_are_refused(synthetic_capture):
    path, _ = synthetic_capture

    def shift(f):
        f["layers/offset"][2] += 16
        f["layers/numel"][2] -= 16

    _edit(path, "capture.h5", shift)
    with pytest.raises(DataError, match=r"layer table is damaged at 'fc\.weight'"):
        open_capture(path)


def test_swapped_and_foreign_rank_files_are_refused(synthetic_capture, tmp_path):
    """Regression (issue 30.4): swapped rank files mislabelled learners, and a rank file
    of another run (same model) was accepted."""
    path, grads = synthetic_capture
    swapped = _copy(path, tmp_path / "swapped")
    os.rename(swapped / rank_file_name(0), swapped / "tmp.h5")
    os.rename(swapped / rank_file_name(1), swapped / rank_file_name(0))
    os.rename(swapped / "tmp.h5", swapped / rank_file_name(1))
    with pytest.raises(
        DataError, match=r"rank-00000.h5 \(learner 0\): holds the rows of learner 1"
    ):
        open_capture(swapped)
    other = write_capture(
        tmp_path / "other", grads[:, ::-1].copy(), open_capture(path).layers, steps=range(6)
    )
    foreign = _copy(path, tmp_path / "foreign")
    shutil.copy(other / rank_file_name(2), foreign / rank_file_name(2))
    with pytest.raises(DataError, match=r"rank-00002.h5 \(learner 2\): belongs to another capture"):
        open_capture(foreign)


@pytest.mark.parametrize(
    "name, edit, message",
    [
        (rank_file_name(1), lambda f: f.attrs.__setitem__("committed", -1), "is not a row count"),
        (rank_file_name(1), lambda f: f.attrs.__setitem__("committed", 7), "committed 7 rows but"),
        (rank_file_name(2), lambda f: f.attrs.__setitem__("committed", 5), "recorded 6 when"),
        ("capture.h5", lambda f: f.attrs.__setitem__("recorded_ranks", [0, 1, 1]), "recorded_ra"),
        ("capture.h5", lambda f: f.attrs.__setitem__("world_size", 2), "recorded_ranks"),
        (rank_file_name(0), lambda f: f["step"].__setitem__(3, 2), "row 3 damaged"),
        (rank_file_name(0), lambda f: f.__delitem__("grad_crc32c"), "/grad_crc32c is missing"),
        (rank_file_name(0), lambda f: f.attrs.__setitem__("run_id", "x"), "another capture"),
    ],
)
def test_bookkeeping_is_validated(synthetic_capture, capsys, name, edit, message):
    """Regression (issue 30.5): committed = -1 read 5 of 6 rows, committed = 5 under a
    complete root read 5 steps, a repeated step read a row twice, recorded_ranks
    [0, 1, 1] read learner 1 twice, a file without checksums read unchecked."""
    path, _ = synthetic_capture
    _edit(path, name, edit)
    result = run_cli(capsys, "similarity", path)
    assert_clean_error(result, code=1)
    assert message in result.stderr
    assert str(path) in result.stderr


def test_a_repeated_step_in_every_file_is_refused(synthetic_capture):
    path, _ = synthetic_capture
    for rank in range(3):
        _edit(path, rank_file_name(rank), lambda f: f["step"].__setitem__(3, 2))
    with pytest.raises(DataError, match=r"\(learner 0\): row 3 damaged"):
        open_capture(path)


def test_old_schemas_warn_what_is_unchecked(synthetic_capture):
    path, _ = synthetic_capture
    _as_schema_1(path)
    with pytest.warns(UserWarning, match="schema 1: no part of it is checksummed"):
        open_capture(path).close()


def test_report_on_a_damaged_capture_is_an_error_unless_allowed(
    synthetic_capture, tmp_path, capsys
):
    """Regression (issue 30.9): `report` on a CRC-damaged capture exited 0 with the
    error only inside the HTML. It is one Error line and exit 1; `--allow-damaged`
    writes the page anyway and says so."""
    path, _ = synthetic_capture
    damaged = _copy(path, tmp_path / "damaged")
    rank_file = damaged / rank_file_name(1)
    offset, _ = _chunk_bytes(rank_file, 3)
    with open(rank_file, "r+b") as f:
        f.seek(offset + 11)
        byte = f.read(1)[0]
        f.seek(offset + 11)
        f.write(bytes([byte ^ 0x40]))
    html = tmp_path / "report.html"
    args = ("report", damaged, "-o", html, "--ratios", "0.1", "--compressors", "topk")
    result = run_cli(capsys, *args)
    assert_clean_error(result, code=1)
    assert f"{rank_file} (learner 1): step 3 is damaged" in result.stderr
    assert not html.exists()
    allowed = run_cli(capsys, *args, "--allow-damaged")
    assert allowed.code == 0, allowed.stderr
    assert "damaged" in allowed.stderr.lower() and "step 3" in html.read_text()
