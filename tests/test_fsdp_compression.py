"""Compression inside FSDP2's reduce-scatter (gradstat/hooks/fsdp_compression.py): real
gloo training, 2 learners (and HSDP on a 2 x 2 mesh of 4), CPU ``fully_shard``
(tests/fsdp_compress_train.py). Each run's recorded ``/sent`` rows equal the replay's at
``--granularity unit`` (FSDP units as messages; under HSDP exchanged within each shard
group, the groups' means averaged) bit for bit, the gradient every step applied equals
the replay's estimate, the bytes agree, and ``gradstat compare`` takes the runs against
the dense FSDP run."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gradstat.analysis.compare import compare
from gradstat.analysis.replay import capture_plan, trained_options
from gradstat.analysis.replay_block import replay_rows
from gradstat.capture.fsdp import ParamSlot, UnitLayout
from gradstat.compressors.plan import build_plan
from gradstat.compressors.registry import build_scheme
from gradstat.compressors.spec import parse_compressors
from gradstat.errors import UsageError
from gradstat.hooks.fsdp_compression import install
from gradstat.store import open_capture
from gradstat.store.schema import layer_table
from tests.helpers import TESTS, assert_clean_error, run_cli, torchrun

SCRIPT = TESTS / "fsdp_compress_train.py"
RUNS = {"topk": 0.1, "fp8-e4m3:algorithm=a2a": None, "bf16+residual": None}
#: HSDP 2 x 2: a compressor with memory and a format (its messages depend on the group)
HSDP_RUNS = {"topk+residual": 0.1, "fp8-e4m3": None}


def folder(run: str) -> str:
    return "".join("_" if c in ":+=" else c for c in run)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp-compress")
    result = torchrun(SCRIPT, "--out", str(out), "--runs", ",".join(["dense", *RUNS]))
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def hsdp_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp-hsdp-compress")
    runs = ",".join(["dense", *HSDP_RUNS])
    result = torchrun(SCRIPT, "--out", str(out), "--runs", runs, "--hsdp", nproc=4)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def check_against_replay(path, run: str, ratio: float | None, learners: int, replicate: int):
    """The run's ``/sent`` rows, bytes and applied gradients against the replay's."""
    with open_capture(path) as cap:
        assert cap.meta["data_parallel"] == "fsdp2" and cap.has_sent
        options = trained_options(cap)
        assert options["granularity"] == "unit"
        plan = capture_plan(cap, cap.scopes("model")[0], **options)
        assert [m.name for m in plan.messages] == ["(root)", "block1", "block2"]
        assert {m.replicate for m in plan.messages} == {replicate}
        spec = parse_compressors(run)[0]
        assert cap.compressor["name"] == spec.label
        scheme = build_scheme(spec, ratio, plan)
        applied = [np.load(path / f"applied-rank{r}.npy") for r in range(learners)]
        assert len(cap.steps) == 3
        for i, step in enumerate(cap.steps):
            replayed = replay_rows(scheme, cap.read_step(step), int(step))
            assert torch.equal(cap.read_step(step, dataset="sent"), replayed.sent)
            for rank in range(learners):  # each learner's shards of the applied mean
                np.testing.assert_array_equal(applied[rank][i], replayed.estimate.numpy())
            assert cap.sent_bytes[:, i].mean() == pytest.approx(replayed.bytes_per_learner)


@pytest.mark.parametrize("run", list(RUNS))
def test_sent_and_applied_equal_the_replay_per_unit(runs, run):
    check_against_replay(runs / folder(run), run, RUNS[run], learners=2, replicate=1)


@pytest.mark.parametrize("run", list(HSDP_RUNS))
def test_hsdp_sent_and_applied_equal_the_replay_per_unit(hsdp_runs, run):
    check_against_replay(hsdp_runs / folder(run), run, HSDP_RUNS[run], learners=4, replicate=2)


def test_a_replay_of_some_hsdp_learners_is_refused(hsdp_runs, capsys):
    args = ["--learners", "0,1", "--compressors", "topk", "--ratios", "0.1"]
    result = run_cli(capsys, "replay", hsdp_runs / "dense", *args)
    assert_clean_error(result, 2)
    assert "needs all 4 learners, not 2" in result.stderr
    result = run_cli(capsys, "replay", hsdp_runs / "dense", *args, "--granularity", "model")
    assert result.code == 0, result.stderr


def test_compare_measures_hsdp_runs_as_their_replay(hsdp_runs):
    """The update ``compare`` rebuilds from the recorded ``/sent`` rows (per shard group,
    the groups averaged) has the replay's error: fp8's emulated reduce-scatter over 2
    learners is exact, top-k's sums are; a built-in with a memory needs no
    --trained-with."""
    paths = [hsdp_runs / folder(run) for run in ["dense", *HSDP_RUNS]]
    errors = compare(paths).errors
    assert sorted(set(errors["run"])) == sorted(folder(run) for run in HSDP_RUNS)
    assert len(errors) == 3 * len(HSDP_RUNS)
    np.testing.assert_allclose(
        errors["measured_rel_error"], errors["replayed_rel_error"], rtol=1e-6
    )
    assert (errors["measured_bytes"] == errors["replayed_bytes"]).all()


@pytest.mark.parametrize("run", ["topk+residual", "fp8-e4m3", "qsgd"])
def test_a_replicated_unit_replays_as_its_shard_groups_averaged(run):
    """The replay of 4 learners in 2 shard groups equals each group's own replay (2
    learners, no replication), the groups' estimates averaged: a plain reference."""
    layers = layer_table([("w", (6, 5)), ("b", (7,))])
    grads = torch.randn(4, 37, generator=torch.Generator().manual_seed(3))
    spec, ratio = parse_compressors(run)[0], 0.2 if run.startswith("topk") else None

    def scheme(replicate: int):
        plan = build_plan(layers, "unit", units=[("u", ["w", "b"], replicate)])
        return build_scheme(spec, ratio, plan)

    hsdp, groups = scheme(2), [scheme(1), scheme(1)]
    for step in range(3):  # memories carried from step to step
        replayed = replay_rows(hsdp, grads * (step + 1), step)
        alone = [
            replay_rows(s, grads[2 * g : 2 * g + 2] * (step + 1), step)
            for g, s in enumerate(groups)
        ]
        assert torch.equal(replayed.sent, torch.cat([a.sent for a in alone]))
        assert torch.equal(replayed.estimate, (alone[0].estimate + alone[1].estimate) / 2)


def test_compare_takes_the_runs_against_the_dense_fsdp_run(runs, capsys):
    paths = [runs / folder(run) for run in ["dense", *RUNS]]
    result = run_cli(capsys, "compare", *paths, "--json")
    assert result.code == 0, result.stderr
    assert "fp8-e4m3:algorithm=a2a:accumulate=fp32" in result.stdout
    assert "bf16:algorithm=ring:accumulate=fp32+residual" in result.stdout


def test_layers_are_refused_with_a_compressor_under_fsdp(tmp_path, capsys):
    result = run_cli(
        capsys, "capture", "--fsdp", "--compressor", "topk", "--ratio", "0.1",
        "--layers", "h", "--steps", "1", "--out", tmp_path / "r",
    )  # fmt: skip
    assert_clean_error(result, 2)
    assert "drop --layers" in result.stderr


def test_cli_capture_trains_with_a_format_inside_the_reduce_scatter(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["--workload", "gpt2", "--size", "tiny", "--steps", "1", "--batch-size", "2"]
    spec = "fp8-e4m3:algorithm=a2a"
    result = run_cli(capsys, "capture", *args, "--fsdp", "--compressor", spec, "--out", out)
    assert result.code == 0, result.stdout + result.stderr
    with open_capture(out) as cap:
        plan = capture_plan(cap, cap.scopes("model")[0], **trained_options(cap))
        assert plan.granularity == "unit" and len(plan.messages) > 2
        scheme = build_scheme(parse_compressors(spec)[0], None, plan)
        replayed = replay_rows(scheme, cap.read_step(0), 0)
        assert torch.equal(cap.read_step(0, dataset="sent"), replayed.sent)


def test_unsharded_units_are_refused():
    layout = UnitLayout("block", [], 1, 1, 1.0, torch.float32)
    with pytest.raises(UsageError, match="sharded over one learner"):
        install(None, [(None, layout)])


class Mesh:
    """A ``(replicate, shard)`` device mesh's ranks, as ``DeviceMesh`` gives them."""

    def __init__(self, ranks: list[list[int]]) -> None:
        self.mesh = torch.tensor(ranks)

    def size(self, dim: int) -> int:
        return self.mesh.shape[dim]


@pytest.mark.parametrize(
    ("ranks", "world"), [([[0, 2], [1, 3]], 4), ([[0, 1], [2, 3]], 8)]
)  # shard groups the replay cannot number: not consecutive; not every learner
def test_hsdp_shard_groups_the_replay_cannot_number_are_refused(ranks, world):
    from torch.distributed.tensor import Replicate, Shard

    param = SimpleNamespace(device_mesh=Mesh(ranks), placements=(Replicate(), Shard(0)))
    layout = UnitLayout("block", [ParamSlot((4,), 0, 0, param)], 2, 2, 1.0, torch.float32)
    with pytest.raises(UsageError, match="consecutive ranks covering every learner"):
        install(SimpleNamespace(world=world), [(None, layout)])
