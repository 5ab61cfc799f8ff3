"""Metadata is checked before it is used (issue 40.4).

Every case edits a copy of a small capture as a hostile writer would: after editing
``capture.h5`` it recomputes the identity checksum (a CRC-32C is no signature, so the
checks below must hold on their own). Each must end in one ``Error:`` naming the file
and the field, or be read as the capture it is; never a ``MemoryError``, a crash or a
wait. Attributes gradstat does not know are ignored, whatever their HDF5 type.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest

from gradstat.errors import DataError, UsageError
from gradstat.store import layer_table, open_capture, write_capture
from gradstat.store.checksums import identity_checksum
from gradstat.store.schema import ROOT_FILE, rank_file_name
from tests.helpers import assert_clean_error, run_cli

LAYERS = layer_table([("conv.weight", (8, 1, 3, 3)), ("conv.bias", (8,)), ("fc.weight", (10, 50))])
R0, R1 = rank_file_name(0), rank_file_name(1)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    rng = np.random.default_rng(0)
    grads = rng.laplace(size=(2, 4, LAYERS[-1].stop)).astype(np.float32)
    return write_capture(tmp_path_factory.mktemp("meta") / "base", grads, LAYERS)


def _resum(path: Path) -> None:
    """Recompute capture.h5's identity checksum from what it now holds."""
    with h5py.File(path / ROOT_FILE, "r+") as f:
        attrs, table = f.attrs, f["layers"]
        if not isinstance(attrs["world_size"], np.integer):
            return  # the check of world_size itself comes first
        world = int(attrs["world_size"])
        ranks = [int(r) for r in attrs.get("recorded_ranks", range(min(world, 64)))]
        rows = zip(
            table["name"].asstr()[()],
            table["offset"][()],
            table["numel"][()],
            table["shape"][()],
            strict=True,
        )
        layers = [(n, int(o), int(k), [int(s) for s in shape]) for n, o, k, shape in rows]
        attrs["checksum"] = np.int64(
            identity_checksum(str(attrs["run_id"]), world, ranks, str(attrs["dtype"]), layers)
        )


def _hostile(base: Path, tmp_path: Path, edit: Callable[[Path], None]) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(base, copy)
    edit(copy)
    _resum(copy)
    return copy


def _attr(name: str, key: str, value) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        with h5py.File(path / name, "r+") as f:
            if value is None:
                del f.attrs[key]
            else:
                f.attrs[key] = value

    return edit


def _layer(index: int, shape: list[int], numel: int | None = None) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        with h5py.File(path / ROOT_FILE, "r+") as f:
            f["layers/shape"][index] = np.array(shape, dtype=np.int64)
            if numel is not None:
                f["layers/numel"][index] = numel

    return edit


def _both(*edits: Callable[[Path], None]) -> Callable[[Path], None]:
    return lambda path: [edit(path) for edit in edits]


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (_attr(R1, "committed", np.int64(10**12)), "committed 1000000000000 rows"),
        (_attr(ROOT_FILE, "committed", np.int64(10**12)), "recorded 1000000000000"),
        (_attr(ROOT_FILE, "world_size", np.int64(5 * 10**7)), "world_size = 50000000"),
        (_attr(ROOT_FILE, "world_size", 2.5), "world_size = 2.5"),
        (_attr(ROOT_FILE, "world_size", "two"), "world_size = 'two'"),
        (_attr(R0, "rank", "x"), "rank = 'x'"),
        (_attr(R0, "writer_pid", 1.5), "writer_pid = 1.5"),
        (_layer(2, [-10, -50]), "shape [-10, -50]"),
        (_layer(2, [2**62 + 1, 256], 256), "shape [4611686018427387905, 256]"),
        (_layer(2, [10**6, 10**6], 10**12), "rows of 580 values"),
    ],
    ids=[
        "rank committed 1e12",
        "root committed 1e12",
        "world_size 5e7",
        "world_size 2.5",
        "world_size text",
        "rank text",
        "writer_pid 1.5",
        "negative shape",
        "shape product wraps",
        "numel 1e12",
    ],
)
def test_a_count_or_shape_the_files_cannot_hold_is_one_error(base, tmp_path, edit, field):
    copy = _hostile(base, tmp_path, edit)
    started = time.monotonic()
    with pytest.raises(DataError) as caught:
        open_capture(copy)
    assert time.monotonic() - started < 10
    assert str(copy) in str(caught.value) and field in str(caught.value), caught.value


def test_a_world_without_its_rank_files_is_named_without_listing_it(base, tmp_path):
    """Regression: world_size 5e7 and no recorded_ranks in a 16 KB capture.h5 took
    5.1 GB; 40 learners claimed beside 2 rank files: the missing files, at once."""
    copy = _hostile(
        base,
        tmp_path,
        _both(_attr(ROOT_FILE, "recorded_ranks", None), _attr(ROOT_FILE, "world_size", 40)),
    )
    with pytest.raises(DataError, match=r"holds 2 rank files: 38 are missing \(rank-00002.h5"):
        open_capture(copy)


def test_a_row_longer_than_its_file_is_damage_not_an_allocation(base, tmp_path):
    """A consistent layer table of 10^12 values and /grad rows of that length whose
    chunks were never written (a file of kilobytes): damaged rows, read nowhere."""
    numel = 10**12

    def huge(path: Path) -> None:
        with h5py.File(path / ROOT_FILE, "r+") as f:
            del f["layers"]
            group = f.create_group("layers")
            group["name"] = np.array([b"w"])
            group["offset"] = np.array([0], np.int64)
            group["numel"] = np.array([numel], np.int64)
            shape = group.create_dataset("shape", (1,), dtype=h5py.vlen_dtype(np.int64))
            shape[0] = np.array([10**6, 10**6], np.int64)
        for name in (R0, R1):
            with h5py.File(path / name, "r+") as f:
                rows, columns = f["grad"].shape[0], 1 << 18
                del f["grad"], f["grad_crc32c"]
                f.create_dataset("grad", (rows, numel), "f4", chunks=(1, columns))
                sums = f.create_dataset("grad_crc32c", (rows, -(-numel // columns)), "u4")
                sums.attrs["columns"] = columns

    copy = _hostile(base, tmp_path, huge)
    with pytest.raises(DataError, match=r"rank-00000.h5 \(learner 0\): steps 0..3 damaged"):
        open_capture(copy)


def test_attributes_gradstat_does_not_know_are_ignored_whatever_their_type(base, tmp_path, capsys):
    """Regression: an object or region reference in capture.h5's attributes was
    "Error: TypeError: no default __reduce__", a versions text that is not JSON an
    "unexpected JSONDecodeError": both are valid files of other writers."""

    def foreign(path: Path) -> None:
        with h5py.File(path / ROOT_FILE, "r+") as f:
            f.attrs["a_reference"] = f.ref
            f.attrs["a_region"] = f["layers/numel"].regionref[0:1]
            f.attrs["a_compound"] = np.array([(1, 2.0)], dtype=[("a", "i4"), ("b", "f8")])
            f.attrs["versions"] = "torch 2 (not JSON)"
            f.attrs["batch_size"] = 32
        with h5py.File(path / R0, "r+") as f:
            f.attrs["a_reference"] = f.ref

    copy = _hostile(base, tmp_path, foreign)
    with open_capture(copy) as cap:
        summary = cap.describe()
        assert cap.meta["batch_size"] == 32 and "a_reference" not in cap.meta
    assert summary["versions"] == "torch 2 (not JSON)"
    result = run_cli(capsys, "similarity", copy, "--ratios", "0.1", "--json")
    assert result.code == 0, result.stderr


def test_a_file_with_checksums_is_checked_whatever_its_schema_says(base, tmp_path):
    """Regression: a schema-3 capture relabelled schema 1 was read without its
    checksums (only the old-schema warning): a flipped value passed."""

    def relabel_and_flip(path: Path) -> None:
        for name in (ROOT_FILE, R0, R1):
            _attr(name, "schema", np.int64(1))(path)
        with h5py.File(path / R1, "r+") as f:
            f["grad"][2, 5] = f["grad"][2, 5] + 1.0

    copy = _hostile(base, tmp_path, relabel_and_flip)
    with open_capture(copy) as cap:
        assert cap.schema == 3 and cap.verification.startswith("CRC-32C per chunk")
        cap.read_step(1)
        with pytest.raises(DataError, match=r"rank-00001.h5 \(learner 1\): step 2 is damaged"):
            cap.read_step(2)


def test_the_root_status_is_borne_out_by_the_rank_files(tmp_path, capsys):
    """Regression: a root status rewritten to "complete" over rank files whose writer
    was killed was shown as is."""
    from tests.test_cli_faults import _killed_capture

    path = _killed_capture(tmp_path / "killed")
    _attr(ROOT_FILE, "status", "complete")(path)
    with open_capture(path) as cap:
        assert cap.status == "interrupted"
    assert "interrupted" in run_cli(capsys, "info", path).stdout


def test_a_huge_learner_count_is_refused_before_anything_starts(capsys, tmp_path):
    """Regression: --nproc-per-node 10^12 was "unexpected MemoryError"."""
    result = run_cli(capsys, "capture", "--nproc-per-node", str(10**12), "--out", tmp_path / "x")
    assert_clean_error(result, UsageError.exit_code)
    assert "--nproc-per-node must be at most 1024" in result.stderr
    assert not (tmp_path / "x").exists()
