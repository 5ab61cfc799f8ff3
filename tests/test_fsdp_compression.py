"""Compression inside FSDP2's reduce-scatter (gradstat/hooks/fsdp_compression.py): real
gloo training, 2 learners (and HSDP on a 2 x 2 mesh of 4), CPU ``fully_shard``
(tests/fsdp_compress_train.py). Each run's recorded ``/sent`` rows equal the replay's at
``--granularity unit`` (FSDP units as messages; under HSDP exchanged within each shard
group, then the groups' means exchanged again by the learners holding each shard) bit
for bit, the gradient every step applied equals the replay's estimate, the bytes agree,
and ``gradstat compare`` takes the runs against the dense FSDP run."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gradstat.analysis.compare import compare
from gradstat.analysis.replay import capture_plan, trained_options
from gradstat.analysis.replay_block import replay_rows
from gradstat.capture.fsdp import ParamSlot, UnitLayout
from gradstat.compressors.plan import Plan, build_plan
from gradstat.compressors.registry import build_scheme
from gradstat.compressors.spec import parse_compressors
from gradstat.errors import UsageError
from gradstat.hooks import compression_hook
from gradstat.hooks.fsdp_compression import install, mark_replicated
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
        assert {m.replicate_compressed for m in plan.messages} == {replicate > 1}
        spec = parse_compressors(run)[0]
        assert cap.compressor["name"] == spec.label
        scheme = build_scheme(spec, ratio, plan)
        # the same run had FSDP averaged the groups densely (a user's own 2-D mesh)
        dense = [replace(m, replicate_compressed=False) for m in plan.messages]
        dense_stage = build_scheme(spec, ratio, Plan(plan.granularity, tuple(dense), plan.blocks))
        applied = [np.load(path / f"applied-rank{r}.npy") for r in range(learners)]
        assert len(cap.steps) == 3
        for i, step in enumerate(cap.steps):
            replayed = replay_rows(scheme, cap.read_step(step), int(step))
            assert torch.equal(cap.read_step(step, dataset="sent"), replayed.sent)
            for rank in range(learners):  # each learner's shards of the applied mean
                np.testing.assert_array_equal(applied[rank][i], replayed.estimate.numpy())
            assert cap.sent_bytes[:, i].mean() == pytest.approx(replayed.bytes_per_learner)
            if replicate > 1:  # the replicate stage ran compressed, and paid its bytes
                plain = replay_rows(dense_stage, cap.read_step(step), int(step))
                assert not np.array_equal(applied[0][i], plain.estimate.numpy())
                assert cap.sent_bytes[:, i].mean() > plain.bytes_per_learner


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
    with open_capture(paths[0]) as dense, open_capture(paths[1]) as trained:
        # the dense run's FSDP all-reduced densely; the prediction replays both stages
        scope = dense.scopes("model")[0]
        assert not any(m.replicate_compressed for m in capture_plan(dense, scope).messages)
        options = trained_options(trained)
        plan = capture_plan(dense, scope, **options)
        assert all(m.replicate_compressed for m in plan.messages)
    errors = compare(paths).errors
    assert sorted(set(errors["run"])) == sorted(folder(run) for run in HSDP_RUNS)
    assert len(errors) == 3 * len(HSDP_RUNS)
    np.testing.assert_allclose(
        errors["measured_rel_error"], errors["replayed_rel_error"], rtol=1e-6
    )
    assert (errors["measured_bytes"] == errors["replayed_bytes"]).all()


@pytest.mark.parametrize("run", ["topk+residual", "fp8-e4m3", "qsgd"])
def test_a_replicated_unit_replays_as_its_shard_groups_averaged(run):
    """The replay of 4 learners in 2 shard groups with FSDP's dense replicate stage
    (a user's own 2-D mesh) equals each group's own replay (2 learners, no
    replication), the groups' estimates averaged: a plain reference."""
    layers = layer_table([("w", (6, 5)), ("b", (7,))])
    grads = torch.randn(4, 37, generator=torch.Generator().manual_seed(3))
    spec, ratio = parse_compressors(run)[0], 0.2 if run.startswith("topk") else None

    def scheme(replicate: int):
        plan = build_plan(layers, "unit", units=[("u", ["w", "b"], replicate, False)])
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


def _topk_residual(p: np.ndarray, k: int) -> np.ndarray:
    """What top-k sends of ``p`` (float32): its k largest magnitudes, zeros elsewhere."""
    sent = np.zeros_like(p)
    keep = np.argsort(-np.abs(p), kind="stable")[:k]
    sent[keep] = p[keep]
    return sent


def test_the_two_stage_replay_equals_a_plain_loop():
    """HSDP with both stages compressed (2 shard groups of 2, top-k with residual error
    feedback) against a plain numpy loop of what gradstat's ``--hsdp`` training does:
    stage 1, each group's top-k mean; stage 2, each group's mean cut into FSDP's shards
    (each parameter padded on dim 0 to a multiple of 2, row after row), the 2 learners
    holding shard s exchanging it with top-k and a memory of their own; the mean over
    the 2 groups laid back. Bit for bit, every step; and not the dense average of the
    groups (stage 2 compresses)."""
    layers = layer_table([("w", (6, 5)), ("b", (7,))])  # b pads to 8: shards of 15 + 4
    plan = build_plan(layers, "unit", units=[("u", ["w", "b"], 2, True)])
    scheme = build_scheme(parse_compressors("topk+residual")[0], 0.2, plan)
    rng = np.random.default_rng(7)
    memory1, memory2 = np.zeros((4, 37), np.float32), np.zeros((4, 19), np.float32)
    k1, k2 = round(0.2 * 37), round(0.2 * 19)
    for step in range(3):
        grads = rng.standard_normal((4, 37)).astype(np.float32)
        means = []
        for g in range(2):  # stage 1: each shard group of 2 consecutive learners
            sent = []
            for i in (2 * g, 2 * g + 1):
                p = grads[i] + memory1[i]
                sent.append(_topk_residual(p, k1))
                memory1[i] = p - sent[-1]
            means.append((sent[0] + sent[1]) / np.float32(2))
        shards = []
        for s in range(2):  # stage 2: learners (0, s) and (1, s), shard s of each mean
            sent = []
            for g in range(2):
                w, b = means[g][:30].reshape(6, 5), np.append(means[g][30:], np.float32(0))
                shard = np.concatenate([w[3 * s : 3 * s + 3].ravel(), b[4 * s : 4 * s + 4]])
                p = shard + memory2[2 * g + s]
                sent.append(_topk_residual(p, k2))
                memory2[2 * g + s] = p - sent[-1]
            shards.append((sent[0] + sent[1]) / np.float32(2))
        expected = np.concatenate(
            [shards[0][:15], shards[1][:15], shards[0][15:], shards[1][15:18]]
        )
        replayed = replay_rows(scheme, torch.from_numpy(grads), step)
        np.testing.assert_array_equal(replayed.estimate.numpy(), expected)
        dense = (means[0] + means[1]) / np.float32(2)
        assert not np.array_equal(replayed.estimate.numpy(), dense)


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
        install(SimpleNamespace(world=world, replicate=1), [(None, layout)])


@pytest.mark.parametrize(
    ("replicate", "wire", "shard_dim", "message"),
    [
        (2, torch.float32, 0, "shard it on the shard group alone"),
        (1, torch.bfloat16, 0, "needs reduce_dtype float32"),
        (1, torch.float32, 1, "FSDP's default Shard"),
    ],
)
def test_a_compressed_replicate_stage_refuses_what_it_cannot_run(
    replicate, wire, shard_dim, message
):
    """compression_hook(replicate=R): a unit on a 2-D mesh (FSDP would all-reduce it
    too), a 16-bit reduce, a parameter sharded on dim 1."""
    slot = ParamSlot((4, 4), shard_dim, 0, torch.zeros(1))
    layout = UnitLayout("block", [slot], 2, replicate, 1.0, wire)
    with pytest.raises(UsageError, match=message):
        mark_replicated([(None, layout)], 2)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"granularity": "unit", "dense_below": 10}, "not supported with a compressed HSDP"),
        ({"granularity": "bucket"}, "compressed inside FSDP2 units"),
    ],
)
def test_a_compressed_replicate_stage_refuses_other_plans(options, message):
    with pytest.raises(UsageError, match=message):
        compression_hook("topk", ratio=0.1, replicate=2, **options)
