"""The communication plan: model, tensor and DDP's buckets, dense exclusions, blocks; the
bucket plan against the buckets a real DDP run (2 gloo learners) hands its hook."""

from __future__ import annotations

import json

import pytest

from gradstat.compressors.plan import build_plan, ddp_buckets
from gradstat.errors import UsageError
from gradstat.store import layer_table
from tests.helpers import TESTS, torchrun

LAYERS = layer_table(
    [
        ("conv.weight", (8, 1, 3, 3)),
        ("conv.bias", (8,)),
        ("fc.weight", (10, 50)),
        ("fc.bias", (10,)),
    ]
)


def names(plan, message) -> list[str]:
    at = {layer.offset: layer.name for layer in LAYERS}
    return [at[offset] for offset, _ in message.slices]


def test_model_and_tensor_plans():
    model = build_plan(LAYERS)
    assert [m.name for m in model.messages] == ["model"]
    assert model.messages[0].shape == (590,) and model.messages[0].slices == (
        (0, 72),
        (72, 8),
        (80, 500),
        (580, 10),
    )
    tensor = build_plan(LAYERS, "tensor")
    assert [m.name for m in tensor.messages] == [layer.name for layer in LAYERS]
    assert [m.shape for m in tensor.messages] == [(8, 1, 3, 3), (8,), (10, 50), (10,)]
    assert tensor.describe() == "tensor (4 messages)"
    # consecutive small tensors are read together: one block, each message its range
    (block,) = tensor.blocks
    assert block.slices == ((0, 590),) and block.ranges == (
        ((0, 72),),
        ((72, 80),),
        ((80, 580),),
        ((580, 590),),
    )


def test_ddp_rule_fills_buckets_in_reverse_order_up_to_their_caps():
    # 4-byte values: fc.bias 40 B, fc.weight 2000 B, conv.bias 32 B, conv.weight 288 B
    assert [[layer.name for layer in b] for b in ddp_buckets(LAYERS, 300, 1000)] == [
        ["fc.bias", "fc.weight"],  # 2040 B >= the first cap of 1000
        ["conv.bias", "conv.weight"],  # 320 B >= 300
    ]
    assert [[layer.name for layer in b] for b in ddp_buckets(LAYERS, 100, 40)] == [
        ["fc.bias"],
        ["fc.weight"],
        ["conv.bias", "conv.weight"],
    ]
    plan = build_plan(LAYERS, "bucket:0.0003")  # 314 B for every bucket, the first too
    assert [names(plan, m) for m in plan.messages] == [
        ["fc.bias", "fc.weight"],
        ["conv.bias", "conv.weight"],
    ]
    assert plan.granularity == "bucket:0.0003"
    # a bucket's block reads its columns once; its message lists them in DDP's order
    assert plan.blocks[0].slices == ((80, 510),)
    assert plan.blocks[0].ranges == (((500, 510), (0, 500)),)
    assert [m.name for m in build_plan(LAYERS, "bucket").messages] == ["bucket0"]


def test_dense_exclusions_travel_as_messages_of_their_own():
    plan = build_plan(LAYERS, dense=r"\.bias$")
    assert [(m.name, m.dense) for m in plan.messages] == [("model", False), ("model (dense)", True)]
    assert names(plan, plan.messages[1]) == ["conv.bias", "fc.bias"]
    assert len(plan.blocks) == 1 and plan.compressed == [0]
    small = build_plan(LAYERS, "tensor", dense_below=80)
    assert [m.dense for m in small.messages] == [True, True, False, True]
    buckets = build_plan(LAYERS, "bucket:0.0003", dense_below=50)
    assert [(m.name, m.dense) for m in buckets.messages] == [
        ("bucket0", False),
        ("bucket0 (dense)", True),
        ("bucket1", False),
        ("bucket1 (dense)", True),
    ]
    assert [len(b.messages) for b in buckets.blocks] == [2, 2]
    assert buckets.describe() == "bucket:0.0003 (4 messages, 2 dense)"


@pytest.mark.parametrize(
    ("granularity", "message"),
    [
        ("layers", "choose model, tensor, bucket"),
        ("bucket:x", "positive MiB"),
        ("bucket:0", "positive MiB"),
        ("tensor:3", "choose model"),
        ("unit", "needs a capture of an FSDP2 run"),
    ],
)
def test_bad_granularities_are_refused(granularity, message):
    with pytest.raises(UsageError, match=message):
        build_plan(LAYERS, granularity)


def test_bad_dense_options_are_refused():
    with pytest.raises(UsageError, match="not a valid regex"):
        build_plan(LAYERS, dense="(")
    with pytest.raises(UsageError, match=">= 0"):
        build_plan(LAYERS, dense_below=-1)


def test_bucket_plan_equals_the_buckets_ddp_hands_its_hook(tmp_path):
    """DDP (gloo, 2 learners) at its default caps and at bucket_cap_mb 0.5 and 0.01: from
    its second iteration (its first puts every parameter in one bucket, in registration
    order: the model plan) the hook receives the plan's buckets, parameters in order."""
    out = tmp_path / "buckets.json"
    result = torchrun(TESTS / "ddp_buckets_train.py", "--out", str(out), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for case in json.loads(out.read_text()).values():
        layers = layer_table([(name, tuple(shape)) for name, shape in case["layers"]])
        at = {layer.offset: layer.name for layer in layers}
        first, *rebuilt = case["iterations"]
        model = build_plan(layers, "model")
        assert [[at[o] for o, _ in m.slices] for m in model.messages] == first
        granularity = "bucket" if case["cap"] is None else f"bucket:{case['cap']}"
        plan = build_plan(layers, granularity)
        assert len(plan.messages) > 1
        for buckets in rebuilt:
            assert [[at[o] for o, _ in m.slices] for m in plan.messages] == buckets
