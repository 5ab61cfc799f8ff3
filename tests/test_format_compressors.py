"""Number formats as compressor specs (gradstat/compressors/cast.py): the replay's
estimate of a format equals the format's rounding and a plain sequential loop of the
collective (tests/test_collectives.py's loops), with error feedback only when a memory
is named; labels state the algorithm and the accumulation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gradstat.analysis.replay import ReplayParams, replay
from gradstat.analysis.replay_block import replay_rows
from gradstat.compressors.cost import Link
from gradstat.compressors.plan import build_plan
from gradstat.compressors.registry import build_scheme
from gradstat.compressors.spec import parse_compressors
from gradstat.errors import UsageError
from gradstat.store import layer_table, open_capture, write_capture
from gradstat.wire.formats import FORMATS
from tests.helpers import run_cli
from tests.test_collectives import LOOPS, _send, tree_loop

LAYERS = [("w", (20, 15)), ("b", (15,))]
SPECS = (
    "fp8-e4m3:algorithm=a2a:accumulate=fp32",
    "bf16:algorithm=ring:accumulate=wire",
    "mxfp4:algorithm=tree",
    "fp16",
)


def plain_mean(rows: list[torch.Tensor], wire: str, algorithm: str, accumulate: str):
    """The all-reduce of ``rows`` by the sequential loops, divided by N: reduce-scatter
    (tree: reduce of the whole vector to learner 0), then each owner's result sent once
    more in the format unless sums are kept in it already."""
    fmt, keep = FORMATS[wire], accumulate == "wire"
    if algorithm == "tree":
        owned = tree_loop(rows, fmt, keep, chunks=False)
    else:
        owned = LOOPS[algorithm](rows, fmt, keep)
    total = torch.cat([o if keep else _send(fmt, o) for o in owned])[: rows[0].numel()]
    return total / len(rows)


def _grads(learners: int = 3, steps: int = 3) -> np.ndarray:
    rng = np.random.default_rng(5)
    d = layer_table(LAYERS)[-1].stop
    shared = rng.normal(size=(1, steps, d))
    return (shared + 0.5 * rng.normal(size=(learners, steps, d))).astype(np.float32)


def test_replay_records_of_formats_equal_the_plain_loops(tmp_path):
    grads = _grads()
    path = write_capture(tmp_path / "cap", grads, layer_table(LAYERS))
    with open_capture(path) as cap:
        params = ReplayParams(",".join(SPECS), (0.1,), Link(1e9, 5e-6), granularity="model")
        frame = replay(cap, params=params)
    labels = sorted(set(frame["compressor"]))
    assert labels == sorted(
        [
            "fp8-e4m3:algorithm=a2a:accumulate=fp32",
            "bf16:algorithm=ring:accumulate=wire",
            "mxfp4:algorithm=tree:accumulate=fp32",
            "fp16:algorithm=ring:accumulate=fp32",
        ]
    )
    for label in labels:
        wire, algorithm, accumulate = (p.split("=")[-1] for p in label.split(":"))
        for step in range(grads.shape[1]):
            rows = [torch.from_numpy(grads[i, step]) for i in range(grads.shape[0])]
            estimate = plain_mean(rows, wire, algorithm, accumulate).double()
            mean = (sum(rows[1:], rows[0].clone()) / len(rows)).double()  # the replay's
            want = float(((estimate - mean) ** 2).sum() / (mean**2).sum())
            got = frame[(frame.compressor == label) & (frame.step == step)]
            assert float(got.rel_error.iloc[0]) == pytest.approx(want, rel=1e-5), label
            # each learner's 3 chunks in the format; tree: a reduce and a broadcast
            nbytes = FORMATS[wire].wire_bytes(grads.shape[2] // 3) * 3
            nbytes *= 2 if algorithm == "tree" else 1
            assert float(got.bytes_per_learner.iloc[0]) == nbytes, label


def test_a_format_keeps_no_memory_unless_one_is_named():
    plan = build_plan(layer_table(LAYERS), "model")
    d = plan.numel
    g = torch.from_numpy(_grads(2, 2)[:, :, :d].copy())
    plain, residual = (
        build_scheme(parse_compressors(name)[0], None, plan)
        for name in ("fp8-e5m2", "fp8-e5m2+residual")
    )
    for t in range(2):
        assert torch.equal(
            replay_rows(plain, g[:, t]).estimate,
            plain_mean(list(g[:, t]), "fp8-e5m2", "ring", "fp32"),
        )
    # error feedback: step 1 sends g + (p0 - what p0 became on the wire, chunk by chunk;
    # the learner's own chunk is added unrounded)
    fmt = FORMATS["fp8-e5m2"]
    replay_rows(residual, g[:, 0])
    chunk = math.ceil(d / 2)
    p1 = []
    for i, (row0, row1) in enumerate(zip(g[:, 0], g[:, 1], strict=True)):
        pieces = [row0[c : c + chunk] for c in range(0, d, chunk)]
        sent = torch.cat([p if j == i else _send(fmt, p) for j, p in enumerate(pieces)])
        p1.append(row1 + (row0 - sent))
    assert torch.equal(
        replay_rows(residual, g[:, 1]).estimate, plain_mean(p1, "fp8-e5m2", "ring", "fp32")
    )


def test_format_specs_are_checked_and_the_table_states_the_collective(tmp_path, capsys):
    for bad, match in [
        ("bf16:algorithm=butterfly", "algorithm must be one of ring, tree, a2a"),
        ("fp8-e4m3:accumulate=fp64", "accumulate must be one of fp32, wire"),
        ("mxfp4:collective=allgather", "exchange is its own"),
    ]:
        with pytest.raises(UsageError, match=match):
            parse_compressors(bad)
    path = write_capture(tmp_path / "cap", _grads(2, 2), layer_table(LAYERS))
    specs = "fp8-e4m3:algorithm=a2a:accumulate=fp32,bf16:algorithm=ring:accumulate=wire"
    result = run_cli(capsys, "replay", path, "--compressors", specs)
    assert result.code == 0, result
    assert "algorithm=a2a:accumulate=fp32" in result.stdout
    assert "algorithm=ring:accumulate=wire" in result.stdout
