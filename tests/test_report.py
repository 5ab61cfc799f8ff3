"""The HTML report, the loss plot, and the README / CI contract."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib.figure import Figure

from gradstat import __version__
from gradstat.cli.main import main
from gradstat.plots.capture import plot_loss
from gradstat.report.sections import SECTIONS
from tests.helpers import assert_clean_error, run_cli

ROOT = Path(__file__).parent.parent
VOID = {"meta", "img", "br", "hr", "link", "input", "wbr"}


class _BalancedHTML(HTMLParser):
    """Checks that every non-void tag is closed in order; collects ids and images."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.ids: list[str] = []
        self.images: list[str] = []
        self.errors: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.append(attrs["id"])
        if tag == "img":
            self.images.append(attrs.get("src", ""))
        if tag not in VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"unexpected </{tag}> with open {self.stack[-3:]}")
        else:
            self.stack.pop()


@pytest.fixture(scope="module")
def report_page(real_capture, tmp_path_factory) -> str:
    """One report of the real capture, read by the two tests below (a report takes
    40-50 s here): every section, at 16 learners, a sparsifier, a low-pass top-k and a
    16-bit cast replayed."""
    out = tmp_path_factory.mktemp("report") / "report.html"
    args = ["--ratios", "0.01", "--compressors", "topk,clt-k,fp16", "--cluster-size", "16"]
    try:
        main(["report", str(real_capture), "-o", str(out), *args])
    except SystemExit as exc:
        assert not exc.code, exc
    return out.read_text()


def test_report_is_valid_html_with_every_section(report_page):
    page = report_page
    assert page.startswith("<!DOCTYPE html>")
    parser = _BalancedHTML()
    parser.feed(page)
    parser.close()
    assert parser.errors == [] and parser.stack == []
    # the sections in order, then the full-size overlay the figures open in
    assert parser.ids == ["summary", *(spec.key for spec in SECTIONS), "zoom"]
    for spec in SECTIONS:
        assert f"<h2>{spec.title}</h2>" in page
    assert "Not available" not in page, re.findall(r"Not available: [^<]*", page)
    figures = parser.images[:-1]  # the overlay's image takes a figure's when opened
    assert len(figures) >= 5 and parser.images[-1] == ""
    assert all(src.startswith("data:image/png;base64,") for src in figures)
    assert page.count('<a href="#zoom"') == len(figures)  # every figure opens full size
    assert "http://" not in page and "https://" not in page  # nothing to fetch
    assert "Assumed: cluster" in page and "compression time: measured here" in page


def test_report_leads_with_the_summary_box_and_states_its_assumptions(report_page, real_capture):
    page = report_page
    assert '<meta name="viewport" content="width=device-width, initial-scale=1">' in page
    summary = page.split('<section id="summary"', 1)[1].split("</section>", 1)[0]
    assert page.index('id="summary"') < page.index('id="overview"')  # the verdict first
    for title in ("Distribution fits", "Top-k similarity", "Gradient build-up", "Recommendation"):
        assert f"<dt>{title}" in summary, title
    assert "fits |g| best" in summary and "for 16 learners" in summary
    for fact in ("link", "cluster size", "target hardware", "options", "capture", "made with"):
        assert f"<td>{fact}</td>" in summary, fact
    assert f"gradstat {__version__}" in summary
    assert "10 Gbit/s, latency 5 us" in summary
    assert str(real_capture) in summary
    # the equivalent `gradstat recommend` call, as code whose options never break
    assert '<span class="word">--cluster-size 16</span>' in summary
    # Tables read as people write them: units, '-' for missing, yes/no, never nan.
    assert ">nan<" not in page and ">True<" not in page and ">False<" not in page
    assert "time per step (ms)" in page and "within budget" in page
    assert page.count('<div class="scroll"><table') >= 5


def test_report_on_an_interrupted_capture_says_so(synthetic_capture, tmp_path, capsys):
    import h5py

    path, _ = synthetic_capture
    with h5py.File(path / "capture.h5", "r+") as f:
        f.attrs["status"] = "running"
    out = tmp_path / "r.html"
    result = run_cli(capsys, "report", path, "-o", out, "--ratios", "0.05", "--compressors", "topk")
    assert result.code == 0, result
    assert "The capture was interrupted and is read up to step 5" in out.read_text()


@pytest.mark.parametrize(
    "args, message",
    [
        (["-o", "report.pdf"], "use a .html file name"),
        (["-o", "/nonexistent/r.html"], "does not exist"),
        (["-o", "r.html", "--ratios", "2"], "strictly between 0 and 1"),
        (["-o", "r.html", "--bandwidth", "fast"], "--bandwidth"),
    ],
)
def test_report_bad_options(synthetic_capture, capsys, args, message):
    path, _ = synthetic_capture
    result = run_cli(capsys, "report", path, *args)
    assert_clean_error(result, code=2)
    assert message in result.stderr


def test_loss_plot_has_one_line_per_learner_plus_mean():
    fig = plot_loss(np.arange(5), np.ones((3, 5)))
    assert isinstance(fig, Figure) and len(fig.axes) == 1
    assert len(fig.axes[0].lines) == 4


def test_readme_quick_start_is_what_ci_and_make_run():
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("```", 2)[1]
    commands = [line.split("#")[0].strip() for line in quick.strip().splitlines()]
    assert commands == ["make demo", "make test"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, flags=re.M)
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^test: ", makefile, flags=re.M) and re.search(
        r"^demo: ", makefile, flags=re.M
    )
    # make installs through scripts/install.py: pinned, with the extras whose tests run
    assert "scripts/install.py --constraints constraints.txt" in makefile
    assert "--extras test,compression,lightning,transformers" in makefile
    assert "torch==2.13.0" in (ROOT / "constraints.txt").read_text()


def test_one_time_per_configuration_and_no_repeated_rows(real_capture):
    from gradstat.report.context import ReportContext, ReportSettings
    from gradstat.report.html import table_html
    from gradstat.report.sections import distinct_quality
    from gradstat.store import open_capture

    with open_capture(real_capture) as cap:
        settings = ReportSettings(ratios=(0.01,), compressors="fp16,topk,clt-k")
        ctx = ReportContext(cap, settings, lambda key: lambda units: units)
        priced = ctx.priced.set_index(["compressor", "ratio"])
        ranking = ctx.recommendation.ranking.set_index(["compressor", "ratio"])
        # the replay section's times are the recommendation's, configuration by one
        for key, row in priced.iterrows():
            assert row["seconds"] == ranking.loc[key, "seconds"]
            assert row["compress_seconds"] == ranking.loc[key, "compress_seconds"]
        assert ctx.target is ctx.recommendation.target  # one profile, measured once
    quality = pd.DataFrame(
        [
            ("sidco-exp", 0.01, "1", 2.5, 2.0, 3.0, 5),
            ("fit:exp", 0.01, "1", 2.5, 2.0, 3.0, 5),  # SIDCo-E stage 1 is that quantile
            ("fit:gamma", 0.01, "1", 1.5, 1.0, 2.0, 5),
        ],
        columns=["estimator", "ratio", "stages", "q median", "q min", "q max", "n"],
    )
    assert list(distinct_quality(quality)["estimator"]) == ["sidco-exp", "fit:gamma"]
    wide = pd.DataFrame([["model", *range(15)]], columns=["scope", *(f"c{i}" for i in range(15))])
    page = table_html(wide)
    assert page.count("<tr>") == 16 and "<th>model</th>" in page  # one row per column


def test_the_equivalent_command_wraps_between_words_only():
    """Regression: at 390 px the report broke `--error-budget` across lines at its hyphen."""
    from gradstat.report.html import command_html

    text = "gradstat recommend /runs/a-b/cap --error-budget 0.5 --compressors fp16,sidco-gpd"
    code = command_html(text)
    for word in ("--error-budget 0.5", "--compressors", "sidco-gpd", "fp16"):
        assert f'<span class="word">{word}</span>' in code
    assert '<span class="path">/runs/a-b/cap</span>' in code
    assert re.sub(r"<[^>]+>", "", code) == text  # copies as the command it is


def test_a_wide_row_named_like_its_column_stands_up():
    """Regression: a capture folder named "run" broke the report ("cannot insert run,
    already exists") where its one-row table of many columns is stood up."""
    from gradstat.report.html import table_html

    row = pd.DataFrame([{"run": "run", **{f"c{i}": float(i) for i in range(10)}}])
    page = table_html(row)
    assert page.count("<th>run</th>") == 2 and "<td>c9</td><td>9</td>" in page
