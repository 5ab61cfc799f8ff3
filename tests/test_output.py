"""The output object and its rendering: summary by default, --detail, --json, progress."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pandas as pd
import pytest

from gradstat.cli import output
from gradstat.cli.output import Output, Result, View, layout, print_view, progress_line, show
from gradstat.cli.similarity import buildup_result, overlap_result
from gradstat.formatting import format_cell


@pytest.mark.parametrize(
    "value, text",
    [
        (float("nan"), "-"),
        (None, "-"),
        (pd.NA, "-"),
        (True, "yes"),
        (np.bool_(False), "no"),
        (0.000123456, "1.235e-04"),
        (23000.4, "23000"),
        (2.5e7, "2.500e+07"),
        (0.5, "0.5"),
        (float("inf"), "inf"),
        (3, "3"),
    ],
)
def test_cells_read_as_people_write_them(value, text):
    assert format_cell(value) == text


def _result() -> Result:
    rows = pd.DataFrame({"step": [0, 1], "value": [0.5, math.nan]})
    return Result(
        rows,
        summary=[View("the summary", rows.tail(1), {"value": "value (ms)"}, "a note")],
        answer=["The answer is 42."],
        detail=[View("every row", rows)],
    )


def test_default_is_summary_and_answer_detail_on_request(capsys):
    show(_result(), Output())
    out = capsys.readouterr().out
    assert "the summary" in out and "value (ms)" in out and "The answer is 42." in out
    assert "every row" not in out and "--detail" in out
    assert "nan" not in out
    show(_result(), Output(detail=True))
    out = capsys.readouterr().out
    assert out.index("every row") < out.index("the summary")


def test_json_is_one_document_and_nothing_else(capsys):
    show(_result(), Output(as_json=True))
    doc = json.loads(capsys.readouterr().out)
    assert doc["records"][1] == {"step": 1, "value": None}
    assert doc["summary"] == [{"step": 1, "value": None}]


def test_progress_line_has_total_and_time_left():
    line = progress_line("fit", 10, 40, 30.0, 90.0)
    assert line == "fit: 10/40 (25%), 0:30 elapsed, about 1:30 left"
    assert progress_line("fit", 1, 40, 30.0) == "fit: 1/40 (2%), 0:30 elapsed"
    assert progress_line("fit", 3, None, 3725.0) == "fit: 3 done, 1:02:05 elapsed"


def test_plain_progress_prints_each_tenth_not_each_unit(capsys, monkeypatch):
    monkeypatch.setattr(output, "PLAIN_PROGRESS_EVERY", 0.0)
    assert len(list(output.progress(range(100), "similarity"))) == 100
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(":")[1].split()[0] for line in lines] == [
        f"{n}/100" for n in range(10, 101, 10)
    ]


def test_plain_progress_time_left_leaves_out_the_first_unit(capsys, monkeypatch):
    """Regression: a slow first unit (loading, compiling) made a 20 s run read 'about
    10:09 left' at 1%."""
    monkeypatch.setattr(output, "PLAIN_PROGRESS_EVERY", 0.0)

    def units():
        for i in range(10):
            time.sleep(2.0 if i == 0 else 0.01)
            yield i

    list(output.progress(units(), "similarity", total=10))
    lines = capsys.readouterr().err.splitlines()
    assert "left" not in lines[0]  # one unit: no estimate yet
    assert lines[1].endswith("about 0:00 left"), lines[1]  # not 0:16 (2 s x 8 units)


def test_plain_progress_lines_when_stderr_is_not_a_terminal(capsys, monkeypatch):
    monkeypatch.setattr(output, "PLAIN_PROGRESS_EVERY", 0.0)
    assert list(output.progress(range(3), "replay")) == [0, 1, 2]
    err = capsys.readouterr().err
    assert "replay: 1/3 (33%)" in err and "replay: 3/3 (100%)" in err


def test_wide_tables_fit_the_terminal_without_cutting_a_number_or_header(capsys):
    """Regression: at 80 columns fit --detail cut numbers mid-digit (c=0.40 / 4), KS to
    0.066... and headers to learn...; now text wraps at spaces and a table too wide is
    printed in parts that repeat its key columns."""
    rng = np.random.default_rng(0)
    rows = pd.DataFrame(
        {"step": [0, 1], "learner": [0, 1], "params": ["c=0.343 scale=0.000576"] * 2}
    )
    for i in range(9):
        rows[f"q@0.00{i + 1}"] = rng.uniform(1e-5, 1e-4, 2)
    print_view(View("wide", rows, keys=2))
    out = capsys.readouterr().out
    width = output.console.width
    assert max(map(len, out.splitlines())) <= width
    words = set(out.split())
    for column in rows.columns:
        assert column in words  # every header whole, never "q@0.…"
    for value in rows.drop(columns="params").to_numpy().ravel():
        assert format_cell(value) in words  # every number whole
    assert {"c=0.343", "scale=0.000576"} <= words
    parts = [line for line in out.splitlines() if line.split()[:2] == ["step", "learner"]]
    assert len(parts) >= 2  # the keys repeated in each part
    assert "…" not in out


def test_layout_wraps_headers_before_cells():
    rows = pd.DataFrame({"compressor": ["topk"], "compress ms": ["4.16  ±32%"], "x": [1.5]})
    ((_, widths),) = layout(rows, 2 + 10 + 3 + 10 + 3 + 3, keys=1)
    assert widths == [10, 10, 3]  # "compress ms" wrapped at its space, the cell whole


def _buildup_records(n: int) -> pd.DataFrame:
    rows = []
    for m in range(1, n + 1):
        rows.append(
            {
                "step": 0,
                "scope": "model",
                "ratio": 0.01,
                "k": 10,
                "d": 1000,
                "m": m,
                "union": 10 * m**0.5,
                "buildup": m**0.5,
                "random_union": 10 * m,
                "random_buildup": float(m),
                "density": 0.01 * m**0.5,
                "allgather_vs_allreduce": 0.01 * m,
            }
        )
    return pd.DataFrame(rows)


def test_long_buildup_tables_show_doubling_m_by_default():
    result = buildup_result(_buildup_records(12), "raw")
    assert list(result.summary[0].rows["m"]) == [1, 2, 4, 8, 12]
    assert len(result.detail[0].rows) == 12
    short = buildup_result(_buildup_records(4), "raw")
    assert [v.title for v in short.detail] == ["build-up per step: B(m) = U(m) / k of m learners"]


def test_buildup_detail_has_every_step():
    """Regression: --detail printed nothing more for a capture of 8 learners or fewer."""
    records = pd.concat(
        [_buildup_records(4).assign(step=s, buildup=lambda r, s=s: r["m"] + s) for s in (0, 5)]
    )
    (per_step,) = buildup_result(records, "raw").detail
    assert list(per_step.rows["step"]) == [0, 5]
    assert per_step.rows[["B(2)", "B(3)", "B(4)"]].values.tolist() == [[2, 3, 4], [7, 8, 9]]


def test_many_learners_overlap_is_two_rows_by_default():
    learners = [*range(10), "mean"]
    records = pd.DataFrame(
        [
            {
                "step": s,
                "next_step": s + 1,
                "gap": 1,
                "scope": "model",
                "ratio": 0.01,
                "k": 5,
                "d": 500,
                "learner": learner,
                "overlap": 0.5 + 0.01 * s,
                "jaccard": 0.3,
                "random_overlap": 0.01,
            }
            for s in range(3)
            for learner in learners
        ]
    )
    result = overlap_result(records, 1, "raw")
    shown = result.summary[0].rows
    assert list(shown["learner"].astype(str)) == ["learners", "mean"]
    assert shown["mean_overlap"].tolist() == pytest.approx([0.51, 0.51])
    assert len(result.detail[0].rows) == len(learners)


def test_plain_progress_repeats_its_line_while_one_unit_runs(capsys, monkeypatch):
    # a replay is one unit of every step: without a heartbeat, minutes of silence
    monkeypatch.setattr(output, "HEARTBEAT_EVERY", 0.2)

    def slow():
        time.sleep(1.0)
        yield "one"

    assert list(output.progress(slow(), "replay", total=1)) == ["one"]
    lines = capsys.readouterr().err.splitlines()
    assert sum(line.startswith("replay: 0/1 (0%)") for line in lines) >= 2
    time.sleep(0.5)  # stopped with the iteration: no line after it
    assert capsys.readouterr().err == ""
