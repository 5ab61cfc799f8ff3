"""recommend's screen on a column sample (gradstat/analysis/screening.py): it must not
change the winner, it names what it dropped, and it says up front what will run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from gradstat.analysis.compute import Compute
from gradstat.analysis.pricing import measure_price, rounds_for
from gradstat.analysis.recommend import RecommendParams, choose, recommend
from gradstat.analysis.replay import Replay
from gradstat.analysis.screening import sample_plan
from gradstat.analysis.selection import Selection
from gradstat.compressors.plan import build_plan
from gradstat.compressors.registry import build_scheme
from gradstat.compressors.spec import parse_compressors
from gradstat.compressors.targets import builtin_target
from gradstat.store import layer_table, open_capture, resolve_scopes
from tests.helpers import run_cli

CPU = Compute(device="cpu", jobs=1)
#: One of each kind of candidate, at the default ratios.
CANDIDATES = "fp16,topk,dgc,sidco-exp,clt-k,gtopk,qsgd,signsgd,powersgd"
BUDGETS = [0.02, 0.3, 0.6, 0.9]


def winners(cap, steps: str, screen: int) -> list:
    """(compressor, ratio) recommend picks at each of :data:`BUDGETS` (None: nothing fits),
    compression priced for an H100 (the work model: the same on every run); with a
    ``screen``, and how many candidates each screen dropped."""
    target = builtin_target("h100")
    selection = Selection.of(cap, steps)
    if not screen:  # one replay of every candidate on the whole model, judged at each budget
        params = RecommendParams(1.0, compressors=CANDIDATES, target=target, screen=0)
        run = Replay(cap, selection, params.replay_params(), compute=CPU)
        records = run.run()
        results = [choose(run, records, error_budget=b, target=target) for b in BUDGETS]
    else:
        results = [
            recommend(
                cap,
                selection,
                RecommendParams(b, compressors=CANDIDATES, target=target, screen=screen),
                compute=CPU,
            )
            for b in BUDGETS
        ]
    picked = [None if r.winner is None else r.to_dict()["recommendation"] for r in results]
    picked = [None if w is None else (w["compressor"], w["ratio"]) for w in picked]
    dropped = [
        0 if r.screen is None else sum(len(g.names) for g in r.screen.dropped) for r in results
    ]
    return picked, dropped


def test_screened_winner_is_the_unscreened_one(real_capture, synthetic_capture):
    """On a real capture (3 learners training the digits CNN) and a synthetic one, at
    budgets from tight to loose: the screen on about 1/8 of the columns picks what a
    replay of every candidate on the whole model picks, and drops some on the way."""
    for path, steps in ((real_capture, "0:3"), (synthetic_capture[0], "0:4")):
        with open_capture(path) as cap:
            every, _ = winners(cap, steps, 0)
            screened, dropped = winners(cap, steps, cap.numel // 8)
        assert screened == every, path
        assert any(every) and sum(dropped) > 0


def test_sample_keeps_the_plans_messages_and_leading_rows():
    layers = layer_table([("w", (40, 50)), ("b", (50,)), ("v", (7, 3, 2))])
    plan = build_plan(layers, "tensor")
    scope = resolve_scopes(layers)[0]
    sample = sample_plan(scope, plan, 4.0)
    shapes = [m.shape for m in sample.plan.messages]
    assert shapes == [(10, 50), (13,), (2, 3, 2)]
    assert [m.slices for m in sample.plan.messages] == [((0, 500),), ((2000, 13),), ((2050, 12),)]
    assert sample.fraction == pytest.approx(2092 / 525)
    # the sample's columns, read as the replay reads them, are those leading rows
    row = torch.arange(2092, dtype=torch.float32)
    taken = sample.scope.take(row)
    assert torch.equal(taken[:500], row[:500]) and torch.equal(taken[500:513], row[2000:2013])
    assert len(sample.plan.blocks) == len(plan.blocks)


def test_recommend_says_what_it_runs_and_names_what_it_dropped(capsys, real_capture):
    args = ["--error-budget", "0.3", "--steps", "0:3", "--jobs", "1", "--json"]
    result = run_cli(capsys, "recommend", real_capture, *args, "--screen", "4000")
    assert result.code == 0, result.stderr
    lines = " ".join(result.stderr.split())  # the notes as one text, however wrapped
    assert "recommend: 40 candidates over 3 steps x 3 learners" in lines
    assert "screen on" in lines and "memories" in lines and "in RAM" in lines
    doc = json.loads(result.stdout)
    dropped = doc["screen"]["dropped"]
    assert {group["reason"] for group in dropped} <= {"over budget", "slower", "dominated"}
    named = [name for group in dropped for name in group["candidates"]]
    ran = {
        c["compressor"] if c["ratio"] is None else f"{c['compressor']}@{c['ratio']:g}"
        for c in doc["candidates"]
    }
    assert named and not ran & set(named) and len(ran) + len(named) == 40
    for name in named:  # each one named on the drop's note line
        assert name in lines
    # --screen 0: no screen, every candidate on the whole model
    result = run_cli(
        capsys, "recommend", real_capture, *args[:-1], "--compressors", "topk,fp16", "--screen", "0"
    )
    assert result.code == 0, result.stderr
    assert "error-feedback memories" in result.stderr and "screen dropped" not in result.stderr


def test_screen_never_drops_every_candidate(synthetic_capture):
    """A budget nobody meets: the closest candidate on the sample still runs, to be named."""
    path, _ = synthetic_capture
    with open_capture(path) as cap:
        params = RecommendParams(1e-9, compressors="topk,randomk", ratios="0.1,0.01", screen=64)
        result = recommend(cap, Selection.of(cap), params, compute=CPU)
    assert result.winner is None
    assert len(result.ranking) == 1 and result.closest["compressor"] == "topk"
    assert np.isfinite(result.closest["rel_error"])


def test_long_steps_are_priced_in_fewer_rounds():
    """recommend's pricing at real size: 9 rounds for a short step, down to 3 for long."""
    assert [rounds_for(s) for s in (0.0, 0.01, 0.2, 0.5, 0.7, 5.0)] == [9, 9, 9, 4, 3, 3]
    layers = layer_table([("w", (64, 64))])
    scheme = build_scheme(parse_compressors("topk")[0], 0.01, build_plan(layers))
    row = torch.randn(64 * 64)
    at_n = measure_price(scheme, row, 4, extrapolate=False, rounds=3)
    assert at_n.per_payload == 0.0 and at_n.at(4) == at_n.base > 0


def test_a_candidate_no_faster_with_far_more_error_is_dropped(synthetic_capture):
    """bf16 beside fp16: the same bytes, the same price on the work model and about 64x
    the error. Listed first, bf16 is dropped as dominated (named with fp16), and fp16
    wins with the screen as without it: recommend breaks a tie in time by error."""
    target = builtin_target("h100")
    with open_capture(synthetic_capture[0]) as cap:
        results = [
            recommend(
                cap,
                Selection.of(cap, "0:4"),
                RecommendParams(0.5, compressors="bf16,fp16", target=target, screen=screen),
                compute=CPU,
            )
            for screen in (0, cap.numel // 8)
        ]
    fp16, bf16 = (f"{f}:algorithm=ring:accumulate=fp32" for f in ("fp16", "bf16"))
    assert [r.to_dict()["recommendation"]["compressor"] for r in results] == [fp16, fp16]
    assert results[0].screen is None
    (group,) = results[1].screen.dropped
    assert (group.reason, group.names) == ("dominated", (bf16,))
    assert f"{bf16} by {fp16}" in group.why
