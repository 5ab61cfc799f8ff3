"""Capture under FSDP2 (``fully_shard``): rows equal an unsharded replica's local
gradients (tests/fsdp_train.py), on 1, 2 and 4 (1-D and HSDP 2 x 2) gloo learners, with
frozen parameters, one unit over several modules and a unit skipped on a step (zeros, with
a warning), and every analysis runs on an FSDP capture."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from gradstat import open_capture
from gradstat.capture.workloads import build_workload
from tests.helpers import TESTS, assert_clean_error, run_cli, torchrun

SCRIPT = TESTS / "fsdp_train.py"
CASES = (
    "plain,accumulate,bf16-reduce,fp16-reduce,bf16-store,shard-dim1,always-sync,unused,"
    "unused-zeros,frozen,grouped,skipped,fp16-params"
)
ALL = CASES + ",replicate-only"
# fp16: FSDP divides by 2 before the reduce-scatter; undone, values below fp16's
# normal range lose their last bits (6e-8, the smallest subnormal)
TOLERANCE = {"fp16-reduce": 6e-8, "fp16-params": 6e-8}
# the storage dtype a capture gets by default: the dtype FSDP reduces in, if 16-bit
DEFAULT_DTYPE = {"bf16-reduce": "bfloat16", "fp16-reduce": "float16", "fp16-params": "float16"}


def _train(out: Path, nproc: int, cases: str) -> Path:
    result = torchrun(SCRIPT, "--out", str(out), "--cases", cases, nproc=nproc, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (out / "stderr.txt").write_text(result.stderr)
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    return _train(tmp_path_factory.mktemp("fsdp2"), 2, ALL)


def _assert_rows_are_local_gradients(
    folder: Path, world: int, learners: list[int], steps: tuple[int, ...] = (0, 1)
) -> None:
    atol = TOLERANCE.get(folder.name, 0.0)
    with open_capture(folder) as cap:
        assert cap.status == "complete"
        assert cap.world_size == world
        assert list(cap.learners) == learners
        assert list(cap.steps) == list(steps)
        for row, (_step, grads) in enumerate(cap.iter_steps()):
            for index, learner in enumerate(learners):
                reference = np.load(folder / f"ref-rank{learner}.npy")[row]
                assert reference.shape == (cap.numel,)
                np.testing.assert_allclose(grads[index].numpy(), reference, rtol=0, atol=atol)
            if len(learners) > 1:
                assert not np.allclose(grads[0].numpy(), grads[1].numpy()), "learners differ"


@pytest.mark.parametrize("case", CASES.split(","))
def test_two_learners_record_their_local_gradients(two_ranks, case):
    learners = [0] if case == "bf16-store" else [0, 1]
    steps = (1,) if case == "unused" else (0, 1)
    _assert_rows_are_local_gradients(two_ranks / case, 2, learners, steps)


def test_storage_defaults_to_the_reduce_dtype(two_ranks):
    for case in CASES.split(","):
        with open_capture(two_ranks / case) as cap:
            expected = "bfloat16" if case == "bf16-store" else DEFAULT_DTYPE.get(case, "float32")
            assert cap.dtype == expected, case


def test_frozen_parameters_are_not_recorded(two_ranks):
    """Frozen parameters inside units (and a unit of frozen ones only) are left out of the
    row, as of the reduce-scatter input; every step is recorded, without a warning."""
    with open_capture(two_ranks / "frozen") as cap:
        names = [layer.name for layer in cap.layers]
    assert "emb.weight" not in names and "block1.0.bias" not in names
    assert not any(name.startswith("block2.") for name in names)
    assert "block1.0.weight" in names
    assert "unit block2 " not in _warnings(two_ranks)


def test_a_unit_skipped_on_a_step_is_zeros_with_one_warning(two_ranks):
    with open_capture(two_ranks / "skipped") as cap:
        extra = [layer for layer in cap.layers if layer.name.startswith("extra.")]
        grads = [cap.read_step(step).numpy() for step in (0, 1)]
    columns = np.concatenate([np.arange(layer.offset, layer.stop) for layer in extra])
    assert np.all(grads[0][:, columns] != 0) and np.all(grads[1][:, columns] == 0)
    warnings = _warnings(two_ranks)
    for rank in range(2):
        message = f"gradstat (rank {rank}): step 1: FSDP unit extra did not reduce-scatter"
        assert warnings.count(message) == 1


def test_one_unit_over_two_modules_is_one_message(two_ranks):
    """capture.h5 names FSDP's units with their layers: torchtitan's norm+head is one."""
    with open_capture(two_ranks / "grouped") as cap:
        names = [layer.name for layer in cap.layers]
        units = json.loads(cap.meta["fsdp_units"])
    grouped = {unit["name"]: [names[i] for i in unit["layers"]] for unit in units}
    assert grouped["norm+head"] == ["norm.weight", "norm.bias", "head.weight", "head.bias"]
    assert grouped["block2"] == ["block2.weight", "block2.bias"]
    assert sorted(i for unit in units for i in unit["layers"]) == list(range(len(names)))
    assert {unit["shard"] for unit in units} == {2}
    assert {unit["reduce_dtype"] for unit in units} == {"float32"}


def _warnings(folder: Path) -> str:
    return (folder / "stderr.txt").read_text()


def test_layers_and_storage_dtype_and_record_ranks(two_ranks):
    with open_capture(two_ranks / "bf16-store") as cap:
        assert cap.dtype == "bfloat16"
        names = [layer.name for layer in cap.layers]
        assert names == [
            "emb.weight",
            "block1.0.weight",
            "block1.0.bias",
            "block2.weight",
            "block2.bias",
        ]
    assert not (two_ranks / "bf16-store" / "rank-00001.h5").exists()


def test_accumulation_without_disabling_sync_warns_and_keeps_the_last_backward(two_ranks):
    stderr = (two_ranks / "stderr.txt").read_text()
    assert "set_requires_gradient_sync(False)" in stderr


def test_a_step_with_an_unused_parameter_is_not_recorded_and_warns(two_ranks):
    """Step 0 leaves a root parameter without gradient: not recorded, with a warning that
    names the unit and the step; with FSDP's ``set_reduce_scatter_unused_params(True)``
    (case unused-zeros) it is recorded, zeros for that parameter."""
    message = "step 0: FSDP unit (root) reduce-scattered only some of its parameters"
    assert _warnings(two_ranks).count(message) == 2  # once per rank
    assert "set_reduce_scatter_unused_params(True)" in _warnings(two_ranks)


def test_hsdp_without_sharding_is_refused_on_every_rank(two_ranks):
    for rank in range(2):
        message = (two_ranks / "replicate-only" / f"error-rank{rank}.txt").read_text()
        assert "replicated over 2 learners without sharding" in message
    assert not (two_ranks / "replicate-only" / "capture.h5").exists()


def test_refusals_are_one_line_usage_errors():
    from torch import nn

    from gradstat.capture import fsdp
    from gradstat.capture.hook_setup import capture_units
    from gradstat.errors import UsageError

    with pytest.raises(UsageError, match="DistributedDataParallel or fully_shard"):
        capture_units(nn.Linear(2, 2), None, None)

    class OldFSDPModule:  # a torch whose FSDP2 has no custom reduce-scatter
        def set_custom_all_gather(self, comm) -> None: ...

    fsdp.check_fsdp_support()  # this torch's FSDPModule has it
    for old in (OldFSDPModule, None):  # an older FSDP2, a torch without FSDP2
        with pytest.raises(UsageError, match=r"needs torch >= 2.11 .*this is torch"):
            fsdp.check_fsdp_support(old)


@pytest.mark.slow  # two learners: the tests above
def test_four_learners_one_and_two_dimensional_and_one_learner(tmp_path):
    """Shards over 4 learners (uneven, some empty: the 2 gain rows), HSDP on a 2 x 2 mesh
    in the same launch, and a world of one."""
    many = _train(tmp_path / "4", 4, "hsdp,plain,accumulate,bf16-reduce")
    for case in ("hsdp", "plain", "accumulate", "bf16-reduce"):
        _assert_rows_are_local_gradients(many / case, 4, [0, 1, 2, 3])
    out = _train(tmp_path / "1", 1, "plain,bf16-reduce")
    for case in ("plain", "bf16-reduce"):
        _assert_rows_are_local_gradients(out / case, 1, [0])


@pytest.mark.parametrize(
    "command",
    [
        ("info",),
        ("fit", "--ratio", "0.1"),
        ("similarity", "--ratio", "0.1"),
        ("buildup", "--ratio", "0.1"),
        ("overlap", "--ratio", "0.1"),
        ("replay", "--ratio", "0.1", "--compressors", "topk,dgc"),
    ],
)
def test_every_analysis_runs_on_an_fsdp_capture(capsys, two_ranks, command):
    result = run_cli(capsys, command[0], two_ranks / "plain", *command[1:], "--json")
    assert result.code == 0, result.stdout + result.stderr
    assert result.stdout.strip().startswith("{")
    if command[0] == "info":
        assert '"data_parallel": "fsdp2"' in result.stdout
        text = run_cli(capsys, "info", two_ranks / "plain").stdout
        assert "FSDP2 reduce-scatter" in text


def test_cli_fsdp_capture_records_each_learners_first_gradient(tmp_path, capsys):
    # gpt2 sharded per block; step 0's rows against each learner's gradient recomputed
    # here from the same seed, shard and batch (a DDP capture of this run gives the same
    # rows bit for bit, docs/capture.md)
    out = tmp_path / "run"
    args = ["--workload", "gpt2", "--size", "tiny", "--steps", "2", "--batch-size", "4"]
    result = run_cli(capsys, "capture", *args, "--fsdp", "--out", out)
    assert result.code == 0, result.stdout + result.stderr
    torch.manual_seed(0)
    workload = build_workload("gpt2", "tiny")
    with open_capture(out) as cap:
        assert cap.status == "complete" and list(cap.steps) == [0, 1]
        names = [layer.name for layer in cap.layers]
        assert names == [name for name, _ in workload.model.named_parameters()]
        recorded = cap.read_step(0).numpy()
    for rank in range(2):
        model = copy.deepcopy(workload.model)
        inputs, targets = next(workload.batches(rank, 2, 4, 0))
        workload.loss(model(inputs), targets).backward()
        local = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()
        np.testing.assert_allclose(recorded[rank], local, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--compressor", "topk", "--ratio", "0.01", "--layers", "h"], "drop --layers"),
        (["--comm-hook", "fp16"], "under --fsdp drop it"),
        (["--hsdp", "2"], "shard groups of at least 2"),
        (["--hsdp", "3", "--nproc-per-node", "4"], "must divide the 4 learners"),
    ],
)
def test_cli_fsdp_refuses_ddp_hooks_in_one_line(tmp_path, capsys, extra, message):
    result = run_cli(capsys, "capture", "--fsdp", "--steps", "2", "--out", tmp_path / "r", *extra)
    assert_clean_error(result, 2)
    assert message in result.stderr
    assert not (tmp_path / "r").exists()


def test_cli_hsdp_needs_fsdp(tmp_path, capsys):
    result = run_cli(capsys, "capture", "--hsdp", "2", "--steps", "2", "--out", tmp_path / "r")
    assert_clean_error(result, 2)
    assert "--hsdp shapes an FSDP2 mesh: add --fsdp" in result.stderr
