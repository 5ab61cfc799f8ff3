"""Capture at cluster scale: a sample of learners, 2-byte storage, compression, disk budget."""

from __future__ import annotations

import json
import warnings

import h5py
import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gradstat import GradientCapture, open_capture
from gradstat.capture import launch
from gradstat.capture.budget import CapturePlan
from gradstat.capture.launch import CaptureOptions
from gradstat.errors import DataError, GradstatWarning, UsageError
from gradstat.sizes import format_bytes, parse_bytes
from gradstat.store import compression
from gradstat.store.compression import COMPRESSIONS
from gradstat.store.dtypes import bfloat16_bits_to_float32
from gradstat.store.ranks import format_ranks, parse_ranks
from gradstat.store.schema import layer_table, rank_file_name
from gradstat.store.writer import RankFileWriter, finalize_root, write_capture, write_root
from tests.helpers import TESTS, assert_clean_error, run_cli, torchrun


def numpy_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16, nearest with ties to even, on the bit patterns alone
    (an implementation independent of torch's)."""
    bits = np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def awkward_floats() -> np.ndarray:
    """Gradient-like values plus every rounding corner: ties (odd and even), subnormals,
    the largest floats (which round to infinity), infinities and signed zeros."""
    rng = np.random.default_rng(0)
    ties = np.array([0x3F808000, 0x3F818000, 0x3F80_8001, 0x3F80_7FFF], np.uint32).view(np.float32)
    corners = np.array(
        [0.0, -0.0, 1e-40, -3e-39, 3.4e38, -3.4e38, np.inf, -np.inf, 1e-8, 65504.0],
        dtype=np.float32,
    )
    noise = (rng.standard_normal(4000) * 10.0 ** rng.uniform(-9, 1, 4000)).astype(np.float32)
    return np.concatenate([ties, -ties, corners, noise])


# --- which learners record ------------------------------------------------------------
def test_record_ranks_spec():
    assert parse_ranks(None, 4) == parse_ranks("all", 4) == [0, 1, 2, 3]
    assert parse_ranks("0,3", 8) == [0, 3]
    assert parse_ranks("2-5", 8) == [2, 3, 4, 5]
    assert parse_ranks("::8", 32) == [0, 8, 16, 24]
    assert parse_ranks("1::4", 10) == [1, 5, 9]
    assert parse_ranks("0:4:2,7,3-4", 8) == [0, 2, 3, 4, 7]
    assert parse_ranks([3, 1, 3], 4) == [1, 3]
    for bad in ("8", "x", "5-2", "::0", "1:2:3:4", "-1", "0,,1"):
        with pytest.raises(UsageError, match="record-ranks"):
            parse_ranks(bad, 8)
    with pytest.raises(UsageError, match="names no rank"):
        parse_ranks("9::2", 8)
    assert format_ranks([0, 1, 2, 3, 8, 16]) == "0-3,8,16"
    assert format_ranks(range(0, 256, 8)) == "0,8,16,24,32,...,248"


def test_a_sample_of_learners_keeps_ranks_and_world_size(tmp_path, capsys):
    grads = np.random.default_rng(1).standard_normal((2, 3, 40)).astype(np.float32)
    layers = layer_table([("w", (40,))])
    write_capture(tmp_path, grads, layers, ranks=[0, 4], world_size=8)
    assert sorted(p.name for p in tmp_path.glob("rank-*")) == [
        rank_file_name(0),
        rank_file_name(4),
    ]
    with open_capture(tmp_path) as cap:
        assert cap.world_size == 8 and cap.learners == [0, 4] and cap.is_sample
        assert cap.learners_text() == "2 of 8 learners (ranks 0,4)"
        np.testing.assert_array_equal(cap.read_step(2, [4]).numpy(), grads[1, 2:3])
        with pytest.raises(UsageError, match=r"learner 1 is not in the capture \(recorded: 0,4\)"):
            cap.read_step(0, [1])
    doc = json.loads(run_cli(capsys, "info", tmp_path, "--json").stdout)
    assert doc["world_size"] == 8 and doc["recorded_ranks"] == [0, 4] and doc["learners"] == 2
    table = run_cli(capsys, "info", tmp_path).stdout
    assert "2 of 8 learners (ranks 0,4)" in table
    # analyses name learners by rank and note the sample; the cost model keeps the run's 8
    result = run_cli(capsys, "replay", tmp_path, "--compressors", "fp16", "--json")
    assert result.code == 0, result
    assert "the run had 8 learners" in result.stderr
    replay = json.loads(result.stdout)
    assert replay["cost_learners"] == 8 and replay["learners"] == 2
    fit = run_cli(
        capsys, "fit", tmp_path, "--learners", "4", "--steps", "1", "--ratios", "0.1", "--json"
    )
    assert fit.code == 0, fit
    assert {r["learner"] for r in json.loads(fit.stdout)["records"]} == {4}
    assert_clean_error(run_cli(capsys, "fit", tmp_path, "--learners", "1"), 2)


def test_record_ranks_and_bfloat16_in_real_training(tmp_path, capsys):
    """3 gloo learners, ranks 0 and 2 record in bfloat16: only their files exist, and each
    row is that learner's own local gradient (computed apart from DDP; their mean over
    all 3 learners is the all-reduced gradient) rounded to bfloat16."""
    result = torchrun(
        TESTS / "ddp_reference_train.py",
        *("--out", str(tmp_path), "--steps", "2", "--record-ranks", "0,2"),
        *("--dtype", "bfloat16"),
        nproc=3,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    local = [np.load(tmp_path / f"local-rank{r}.npy") for r in range(3)]
    reduced = np.load(tmp_path / "reference-rank0.npy")
    np.testing.assert_allclose(np.mean(local, axis=0), reduced, rtol=1e-5, atol=1e-7)
    assert sorted(p.name for p in tmp_path.glob("rank-*.h5")) == [
        rank_file_name(0),
        rank_file_name(2),
    ]
    for rank in (0, 2):
        with h5py.File(tmp_path / rank_file_name(rank), "r") as f:
            assert f["grad"].dtype == np.uint16 and f["grad"].attrs["gradstat_dtype"] == "bfloat16"
            np.testing.assert_array_equal(f["grad"][:], numpy_bfloat16_bits(local[rank]))
    with h5py.File(tmp_path / "capture.h5", "r") as root:
        assert root.attrs["world_size"] == 3 and list(root.attrs["recorded_ranks"]) == [0, 2]
        assert root["grad"].shape == (2, 2, local[0].shape[1])
    with open_capture(tmp_path) as cap:
        assert cap.learners == [0, 2] and cap.status == "complete"
        for row, (_, grads) in enumerate(cap.iter_steps()):
            for i, rank in enumerate(cap.learners):
                expected = bfloat16_bits_to_float32(numpy_bfloat16_bits(local[rank][row]))
                np.testing.assert_array_equal(grads[i].numpy(), expected)


# --- 2-byte storage ---------------------------------------------------------------------
def test_bfloat16_rows_are_float32_rounded_to_nearest_even(tmp_path):
    values = awkward_floats()
    grads = np.stack([values, -values])[:, None, :]
    write_capture(tmp_path, grads, layer_table([("w", values.shape)]), dtype="bfloat16")
    expected_bits = numpy_bfloat16_bits(values)
    assert expected_bits[0] == 0x3F80 and expected_bits[1] == 0x3F82  # ties go to even
    assert expected_bits[2] == 0x3F81 and expected_bits[3] == 0x3F80  # no tie: nearest
    # a plain h5py reader: the two lines docs/format.md shows
    with h5py.File(tmp_path / rank_file_name(0), "r") as f:
        bits = f["grad"][0]
        floats = (bits.astype(np.uint32) << 16).view(np.float32)
        assert f["grad"].attrs["gradstat_dtype"] == "bfloat16"
    np.testing.assert_array_equal(bits, expected_bits)
    with open_capture(tmp_path) as cap:
        assert cap.dtype == "bfloat16"
        row = cap.read_step(0).numpy()
    np.testing.assert_array_equal(row[0], floats)
    np.testing.assert_array_equal(row[1], -floats)
    finite = np.isfinite(floats) & (np.abs(values) > 1e-37)
    assert np.all(np.abs(floats[finite] - values[finite]) <= np.abs(values[finite]) * 2.0**-8)


def test_float16_limits_are_what_the_docs_say(tmp_path):
    values = np.array([1e-8, 6e-8, 1.0, 65504.0, 70000.0], dtype=np.float32)
    write_capture(tmp_path, values[None, None, :], layer_table([("w", (5,))]), dtype="float16")
    with open_capture(tmp_path) as cap:
        row = cap.read_step(0)[0].numpy()
    assert row[0] == 0 and row[1] > 0 and row[3] == 65504 and np.isinf(row[4])


def test_mismatched_storage_type_is_a_data_error(tmp_path):
    write_capture(tmp_path, np.ones((1, 1, 4), np.float32), layer_table([("w", (4,))]))
    with h5py.File(tmp_path / "capture.h5", "r+") as root:
        root.attrs["dtype"] = "bfloat16"
    with pytest.raises(DataError, match=r"capture\.h5: the capture's identity or layer"):
        open_capture(tmp_path)  # the root's checksum covers its dtype


# --- compression ----------------------------------------------------------------------
@pytest.mark.parametrize("name", list(COMPRESSIONS))
def test_compressed_rows_read_back_exactly(tmp_path, name):
    if name in ("lz4", "zstd"):
        pytest.importorskip("hdf5plugin")
    values = awkward_floats()
    writer = RankFileWriter(tmp_path / "r.h5", 0, values.size, "float32", name)
    writer.append(0, 0.5, values)
    writer.append(1, 0.5, np.zeros_like(values))
    writer.close()
    with h5py.File(tmp_path / "r.h5", "r") as f:
        np.testing.assert_array_equal(f["grad"][0], values)
        assert not f["grad"][1].any()


def test_missing_filter_plugin_is_a_clear_data_error(tmp_path, monkeypatch):
    pytest.importorskip("hdf5plugin")
    write_capture(tmp_path, np.ones((1, 1, 64), np.float32), layer_table([("w", (64,))]))
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("grad", data=np.ones((1, 64), np.float32), **COMPRESSIONS["zstd"]())
    monkeypatch.setattr(compression.h5py.h5z, "filter_avail", lambda _: False)
    monkeypatch.setattr(compression, "_import_hdf5plugin", lambda: None)
    with h5py.File(path, "r") as f, pytest.raises(DataError, match="pip install hdf5plugin"):
        compression.ensure_readable(f["grad"], path)


def test_unknown_compression_is_a_usage_error():
    with pytest.raises(UsageError, match="compression must be one of"):
        RankFileWriter("/nonexistent/r.h5", 0, 4, "float32", "brotli")


# --- the disk budget ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("learners", "rows", "numel", "dtype"),
    [(2, 3, 1000, "float32"), (3, 20, 300_000, "bfloat16"), (1, 4, 700_000, "float32")],
)
def test_expected_size_bounds_the_real_files(tmp_path, learners, rows, numel, dtype):
    grads = np.zeros((learners, rows, numel), np.float32)
    layers = layer_table([("a", (numel // 2,)), ("b", (numel - numel // 2,))])
    write_capture(tmp_path, grads, layers, dtype=dtype)
    actual = sum(p.stat().st_size for p in tmp_path.glob("*.h5"))
    plan = CapturePlan(rows=rows, learners=learners, numel=numel, dtype=dtype, layers=2)
    assert plan.data_bytes == rows * learners * numel * (4 if dtype == "float32" else 2)
    assert actual <= plan.expected_bytes <= actual + 0.02 * plan.data_bytes + (400 << 10)


def test_sizes_parse_and_print_in_one_convention():
    """MB = 10^6 and MiB = 2^20 in every size option; a bare M is refused; sizes print
    in decimal units."""
    assert parse_bytes("1000") == 1000
    assert parse_bytes("500MB") == 500 * 10**6 and parse_bytes("500MiB") == 500 << 20
    assert parse_bytes("1.5TB") == 1_500_000_000_000 and parse_bytes("2 kB") == 2000
    for bad in ("", "ten", "5X", "0", "-3GB"):
        with pytest.raises(UsageError, match="max-bytes"):
            parse_bytes(bad, "--max-bytes")
    with pytest.raises(UsageError, match=r"say 500MB \(decimal\) or 500MiB"):
        parse_bytes("500M", "--max-bytes")
    assert format_bytes(512) == "512 B"
    assert format_bytes(1.5e9) == "1.5 GB" and format_bytes(219.5e6) == "219.5 MB"
    assert format_bytes(6.4e12) == "6.4 TB"


def test_capture_refuses_a_capture_over_max_bytes(tmp_path, capsys):
    out = tmp_path / "run"
    result = run_cli(
        capsys,
        "capture",
        "--workload",
        "digits",
        "--steps",
        "50",
        "--max-bytes",
        "1MB",
        "--out",
        out,
    )
    assert_clean_error(result, 2)
    message = result.stderr
    assert "more than the limit of 1 MB" in message
    assert "50 rows x 2 learners x 38,282 values x 4 B" in message
    for hint in ("--every", "--layers", "--record-ranks", "--dtype"):
        assert hint in message
    assert not out.exists()


def test_capture_refuses_a_capture_over_the_free_space(tmp_path, monkeypatch):
    options = CaptureOptions(workload="digits", steps=10, out=tmp_path / "run")
    monkeypatch.setattr(launch, "free_bytes", lambda _: 10 << 20)
    plan, free = launch.check_budget(options, tmp_path / "run")  # 3 MiB fits in 10 MiB
    assert free == 10 << 20 and plan.learners == 2 and plan.numel == 38282
    monkeypatch.setattr(launch, "free_bytes", lambda _: 10**6)
    with pytest.raises(UsageError, match=r"but only 1 MB are free; record less: --every"):
        launch.check_budget(options, tmp_path / "run")
    sampled = CaptureOptions(workload="digits", steps=10, record_ranks="1", nproc_per_node=4)
    assert sampled.plan().learners == 1
    node = CaptureOptions(
        workload="digits", nproc_per_node=2, nnodes=2, node_rank=1, record_ranks="::2"
    )
    assert node.plan().learners == 1 and not node.plan().root  # rank 2 on this node


@pytest.fixture
def single_process_group(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def test_gradient_capture_warns_when_the_capture_would_not_fit(tmp_path, single_process_group):
    model = DistributedDataParallel(torch.nn.Linear(100, 10))
    with pytest.warns(GradstatWarning, match=r"more than the limit.*record_ranks=SPEC"):
        GradientCapture(model, tmp_path / "a", total_steps=1000, max_bytes=1 << 20).close()
    model = DistributedDataParallel(torch.nn.Linear(100, 10))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        capture = GradientCapture(
            model, tmp_path / "b", total_steps=10, max_bytes=1 << 20, dtype="bfloat16"
        )
        for step in range(2):
            model(torch.ones(3, 100)).sum().backward()
            capture.step(step)
            capture.flush()  # the row is in the file once flush returns
            assert capture.rows_written == step + 1
        capture.close()
    with open_capture(tmp_path / "b") as cap:
        assert cap.learners == [0] and list(cap.steps) == [0, 1]
        # d(sum of outputs)/d(bias) is 3 per output and step (never zeroed): exact in bfloat16
        for step, bias_grad in ((0, 3.0), (1, 6.0)):
            np.testing.assert_array_equal(cap.read_step(step)[0, -10:].numpy(), bias_grad)


@pytest.mark.parametrize(
    ("rows", "numel", "dtype"), [(3, 200_000, "float32"), (20, 300_000, "bfloat16")]
)
def test_expected_size_counts_the_sent_rows_of_a_compressor(tmp_path, rows, numel, dtype):
    # issue 29: --compressor records /sent beside /grad; the estimate once left it out
    # and a capture "expected 10.9 MiB" wrote 22 MB
    layers = layer_table([("a", (numel,))])
    write_root(tmp_path, layers, 2, dtype, {"workload": "arrays", "backend": "none"}, [0, 1])
    values = np.random.default_rng(0).standard_normal(numel).astype(np.float32)
    for rank in range(2):
        with RankFileWriter(tmp_path / rank_file_name(rank), rank, numel, dtype, sent=True) as w:
            for step in range(rows):
                w.append(step, 0.0, values, values, 100.0)
    finalize_root(tmp_path)
    actual = sum(p.stat().st_size for p in tmp_path.glob("*.h5"))
    plan = CapturePlan(rows=rows, learners=2, numel=numel, dtype=dtype, layers=1, sent=True)
    without = CapturePlan(rows=rows, learners=2, numel=numel, dtype=dtype, layers=1)
    assert plan.data_bytes == 2 * without.data_bytes
    assert actual <= plan.expected_bytes <= actual + 0.02 * plan.data_bytes + (400 << 10)
    assert without.expected_bytes < actual


def test_capture_with_a_compressor_refuses_what_its_sent_rows_would_exceed(tmp_path, capsys):
    options = CaptureOptions(workload="digits", steps=10, compressor="topk", ratio=0.01)
    plan = options.plan()
    assert plan.sent and plan.data_bytes == 10 * 2 * 38282 * 4 * 2
    gradients_only = CaptureOptions(workload="digits", steps=10).plan().expected_bytes
    limit = (gradients_only + plan.expected_bytes) // 2  # fits /grad alone, not with /sent
    out = tmp_path / "run"
    args = ["--workload", "digits", "--steps", "10", "--max-bytes", str(limit), "--out", out]
    result = run_cli(capsys, "capture", *args, "--compressor", "topk", "--ratio", "0.01")
    assert_clean_error(result, 2)
    assert "x 2 (gradient and sent)" in result.stderr
    assert "more than the limit" in result.stderr
    assert not out.exists()
