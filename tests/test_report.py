"""The HTML report, the loss plot, and the README / CI contract."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from matplotlib.figure import Figure

from gradstat import __version__
from gradstat.plots.capture import plot_loss
from gradstat.report.build import SECTIONS
from tests.helpers import assert_clean_error, run_cli

ROOT = Path(__file__).parent.parent
VOID = {"meta", "img", "br", "hr", "link", "input"}


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


def test_report_is_valid_html_with_every_section(real_capture, tmp_path, capsys):
    out = tmp_path / "report.html"
    result = run_cli(
        capsys,
        "report",
        real_capture,
        "-o",
        out,
        "--ratios",
        "0.01",
        "--compressors",
        "topk,clt-k",
    )
    assert result.code == 0, result
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>")
    parser = _BalancedHTML()
    parser.feed(page)
    parser.close()
    assert parser.errors == [] and parser.stack == []
    assert parser.ids == ["summary", *(spec.key for spec in SECTIONS)]
    for spec in SECTIONS:
        assert f"<h2>{spec.title}</h2>" in page
    assert "Not available" not in page, re.findall(r"Not available: [^<]*", page)
    assert len(parser.images) >= 5
    assert all(src.startswith("data:image/png;base64,") for src in parser.images)
    assert "http://" not in page and "https://" not in page  # nothing to fetch


def test_report_leads_with_the_summary_box_and_states_its_assumptions(
    real_capture, tmp_path, capsys
):
    out = tmp_path / "report.html"
    args = ["--ratios", "0.01", "--compressors", "topk,fp16", "--cluster-size", "16"]
    result = run_cli(capsys, "report", real_capture, "-o", out, *args)
    assert result.code == 0, result
    page = out.read_text()
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
    assert "--cluster-size 16" in summary  # the equivalent `gradstat recommend` call
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
        (["-o", "r.html", "--ratios", "2"], "outside (0, 1)"),
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
    assert "-c constraints.txt" in makefile
    assert "torch==2.13.0" in (ROOT / "constraints.txt").read_text()
