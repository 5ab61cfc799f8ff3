"""The capture format: round trip, scopes, selection, and every kind of bad file."""

from __future__ import annotations

import shutil
import subprocess
import warnings

import h5py
import numpy as np
import pytest
import torch

from gradstat import open_capture
from gradstat.analysis.selection import parse_ratios, select_learners, select_steps
from gradstat.errors import DataError, UsageError
from gradstat.store import layer_table, write_capture
from gradstat.store.schema import rank_file_name
from tests.helpers import assert_clean_error, run_cli


def test_round_trip_is_exact(synthetic_capture):
    path, grads = synthetic_capture
    with open_capture(path) as cap:
        assert cap.world_size == 3 and cap.numel == grads.shape[2] and cap.status == "complete"
        for row, (step, tensor) in enumerate(cap.iter_steps()):
            assert step == row
            np.testing.assert_array_equal(tensor.numpy(), grads[:, row])
        np.testing.assert_array_equal(cap.read_step(2, learners=[2, 0]).numpy(), grads[[2, 0], 2])


def test_scopes_slice_the_flat_vector(synthetic_capture):
    path, grads = synthetic_capture
    with open_capture(path) as cap:
        row = cap.read_step(0)
        (model,) = cap.scopes("model")
        assert model.numel == cap.numel and torch.equal(model.take(row), row)
        per_layer = cap.scopes("layers")
        assert [s.name for s in per_layer] == ["conv.weight", "conv.bias", "fc.weight"]
        assert torch.equal(torch.cat([s.take(row) for s in per_layer], 1), row)
        (weights,) = cap.scopes(r"weight$")
        expected = np.concatenate([grads[:, 0, :72], grads[:, 0, 80:]], axis=1)
        np.testing.assert_array_equal(weights.take(row).numpy(), expected)
        with pytest.raises(UsageError, match="matches no layer"):
            cap.scopes("nothing-like-this")


def test_selection_parsing():
    recorded = [0, 5, 10, 15, 20]
    assert select_steps(recorded, None) == recorded
    assert select_steps(recorded, "5:16") == [5, 10, 15]
    assert select_steps(recorded, "::2") == [0, 10, 20]
    assert select_steps(recorded, "10,20") == [10, 20]
    for bad in ("7", "100:200", "a:b", "0:10:0"):
        with pytest.raises(UsageError):
            select_steps(recorded, bad)
    assert select_learners(range(4), "0,2") == [0, 2]
    for bad in ("5", "0,0", "x"):
        with pytest.raises(UsageError):
            select_learners(range(4), bad)
    with pytest.raises(UsageError, match="at least 2"):
        select_learners([0], None, minimum=2)
    # a capture of a sample of learners: learners keep their rank in the run
    assert select_learners([0, 8, 16], None) == [0, 8, 16]
    assert select_learners([0, 8, 16], "16,8") == [16, 8]
    with pytest.raises(UsageError, match=r"learner 1 is not in the capture \(recorded: 0,8,16\)"):
        select_learners([0, 8, 16], "0,1")
    assert parse_ratios("0.1,0.001") == [0.1, 0.001]
    for bad in ("0", "1", "-0.1", "nan", "x"):
        with pytest.raises(UsageError):
            parse_ratios(bad)


def test_float16_storage(tmp_path):
    layers = layer_table([("w", (3, 5))])
    grads = np.random.default_rng(1).normal(size=(2, 3, 15)).astype(np.float32)
    write_capture(tmp_path / "c", grads, layers, dtype="float16")
    with open_capture(tmp_path / "c") as cap:
        np.testing.assert_allclose(cap.read_step(1).numpy(), grads[:, 1], rtol=1e-3, atol=1e-3)


def _bad_inputs(tmp_path, synthetic_capture):
    path, _ = synthetic_capture
    text = tmp_path / "notes.txt"
    text.write_text("not hdf5")
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["x"] = [1, 2, 3]
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    for name in ("capture.h5", rank_file_name(0)):
        data = (path / name).read_bytes()
        (truncated / name).write_bytes(data[: len(data) // 2])
    return {
        "missing": (tmp_path / "nope", "no such file"),
        "text": (text, "not an HDF5 file"),
        "other-hdf5": (other, "not a gradstat capture"),
        "empty-dir": (tmp_path, "not a gradstat capture"),
        "truncated": (truncated, "cannot be read"),
    }


@pytest.mark.parametrize("case", ["missing", "text", "other-hdf5", "empty-dir", "truncated"])
def test_bad_files_give_one_error_line(tmp_path, synthetic_capture, capsys, case):
    """A missing path is bad usage (exit 2, issue 30.12); the others bad data (exit 1)."""
    target, message = _bad_inputs(tmp_path, synthetic_capture)[case]
    error, code = (UsageError, 2) if case == "missing" else (DataError, 1)
    with pytest.raises(error, match=message):
        open_capture(target)
    result = run_cli(capsys, "info", target)
    assert_clean_error(result, code=code)
    assert message in result.stderr


def test_missing_rank_file(synthetic_capture, capsys):
    path, _ = synthetic_capture
    (path / rank_file_name(1)).unlink()
    result = run_cli(capsys, "info", path)
    assert_clean_error(result, code=1)
    assert rank_file_name(1) in result.stderr


def test_reader_trusts_only_committed_rows(synthetic_capture):
    path, _grads = synthetic_capture
    with h5py.File(path / rank_file_name(1), "r+") as f:
        f.attrs["committed"] = 4  # as if learner 1 died after its 4th row
    with pytest.raises(DataError, match=r"rank-00001.h5 \(learner 1\): committed 4 rows, but"):
        open_capture(path)  # capture.h5 recorded 6 rows at its clean close
    with h5py.File(path / "capture.h5", "r+") as f:  # the capture never closed
        f.attrs["status"] = "running"
        del f.attrs["committed"]
    with open_capture(path) as cap:
        assert list(cap.steps) == [0, 1, 2, 3]
        assert cap.committed_per_learner == [6, 4, 6]
        with pytest.raises(UsageError, match="not a committed step"):
            cap.read_step(5)


def _attribute_types(path):
    with h5py.File(path, "r", swmr=True) as f:
        return [(name, f.attrs.get_id(name).dtype) for name in f.attrs]


def test_attributes_use_types_every_hdf5_tool_reads(synthetic_capture):
    """Regression: a Python bool attribute became an HDF5 enum that h5dump cannot open."""
    path, _ = synthetic_capture
    for file in sorted(path.glob("*.h5")):
        for name, dtype in _attribute_types(file):
            assert h5py.check_enum_dtype(dtype) is None, f"{file.name}:{name} is an enum"


@pytest.mark.skipif(shutil.which("h5dump") is None, reason="h5dump (hdf5-tools) not installed")
def test_h5dump_and_h5ls_read_every_file(synthetic_capture):
    path, _ = synthetic_capture
    for file in sorted(path.glob("*.h5")):
        for tool in (["h5dump", "-A"], ["h5ls", "-r"]):
            result = subprocess.run([*tool, str(file)], capture_output=True, text=True)
            assert result.returncode == 0 and "error" not in result.stderr.lower(), result


def test_info_csv_writes_the_layer_table(synthetic_capture, tmp_path, capsys):
    import pandas as pd

    path, grads = synthetic_capture
    out = tmp_path / "layers.csv"
    result = run_cli(capsys, "info", path, "--csv", out)
    assert result.code == 0, result
    table = pd.read_csv(out)
    assert list(table["name"]) == ["conv.weight", "conv.bias", "fc.weight"]
    assert list(table["offset"]) == [0, 72, 80]
    assert int(table["numel"].sum()) == grads.shape[2]


def _rewrite(file, name, data, **kwargs):
    """Replace dataset ``name`` of ``file`` by ``data`` in another layout."""
    with h5py.File(file, "r+") as f:
        attrs = dict(f[name].attrs)
        del f[name]
        f.create_dataset(name, data=data, **kwargs)
        f[name].attrs.update(attrs)


@pytest.mark.parametrize("schema", [3, 1])
def test_layouts_other_tools_write_are_read(synthetic_capture, schema):
    """Regression (issue 30.11): contiguous /step and /loss (plain h5py's default) were
    'damaged: its chunk index cannot be read', big-endian float32 rows were refused."""
    path, grads = synthetic_capture
    for rank in range(3):
        file = path / rank_file_name(rank)
        with h5py.File(file, "r") as f:
            steps, losses, rows = f["step"][()], f["loss"][()], f["grad"][()]
            chunks = f["grad"].chunks
        _rewrite(file, "step", steps)
        _rewrite(file, "loss", losses)
        _rewrite(file, "grad", rows.astype(">f4"), chunks=chunks, maxshape=(None, rows.shape[1]))
        if schema == 1:
            with h5py.File(file, "r+") as f:
                f.attrs["schema"] = 1
                del f["grad_crc32c"], f["record_crc32c"]
    if schema == 1:
        with h5py.File(path / "capture.h5", "r+") as f:
            f.attrs["schema"] = 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with open_capture(path) as cap:
            assert cap.status == "complete" and list(cap.steps) == list(range(6))
            for step in range(6):
                np.testing.assert_array_equal(cap.read_step(step).numpy(), grads[:, step])
            np.testing.assert_array_equal(
                cap.read_row(2, 1, columns=slice(75, 90)), grads[1, 2, 75:90]
            )
