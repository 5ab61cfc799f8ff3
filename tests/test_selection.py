"""One shape for every analysis: Selection, parsed parameters and Compute."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

import gradstat
from gradstat.analysis.buildup import BuildupParams, buildup
from gradstat.analysis.compute import MAX_BLOCK, ROWS_ALIVE, Compute
from gradstat.analysis.fit import FitParams, fit
from gradstat.analysis.overlap import OverlapParams, overlap
from gradstat.analysis.selection import Selection
from gradstat.analysis.similarity import SimilarityParams, similarity
from gradstat.cli.main import load_command
from gradstat.errors import UsageError
from gradstat.sizes import parse_bytes
from gradstat.store import open_capture


def test_text_and_python_values_select_the_same(synthetic_capture):
    path, _ = synthetic_capture
    with open_capture(path) as cap:
        assert Selection.of(cap, "1:5:2", "0,2") == Selection.of(cap, [1, 3], [0, 2])
        assert Selection.of(cap, 4, 1) == Selection((4,), (1,), "model")
        everything = Selection.of(cap)
        assert everything.steps == tuple(range(6)) and everything.learners == (0, 1, 2)


@pytest.mark.parametrize(
    ("steps", "learners", "scope", "message"),
    [
        (None, [7], "model", "learner 7 is not in the capture"),
        (None, [0, 0], "model", "learners=[0, 0] names a learner twice"),
        (None, "a,b", "model", "learners='a,b'"),
        ([99], None, "model", "step 99 was not recorded"),
        ("::0", None, "model", "steps='::0'"),
        ([1.5], None, "model", "steps=[1.5]: expected integers"),
        (None, None, "nothing", "scope='nothing' matches no layer"),
    ],
)
def test_errors_name_parameters(synthetic_capture, steps, learners, scope, message):
    path, _ = synthetic_capture
    with open_capture(path) as cap, pytest.raises(UsageError, match=message.replace("[", r"\[")):
        Selection.of(cap, steps, learners, scope)


def test_params_parse_text_and_sequences_alike():
    assert BuildupParams("0.01,0.001") == BuildupParams([0.01, 0.001])
    assert BuildupParams("0.01").ratios == (0.01,)
    assert SimilarityParams(0.01) == SimilarityParams("0.01")
    assert FitParams(dists="gpd,exp", stages="auto") == FitParams(dists=["gpd", "exp"], stages=None)
    with pytest.raises(UsageError, match="on='dense'"):
        SimilarityParams(0.01, on="dense")
    with pytest.raises(UsageError, match="lag=0"):
        OverlapParams(0.01, lag=0)
    with pytest.raises(UsageError, match="outside"):
        BuildupParams([0.5, 1.5])


def test_fit_takes_python_lists(synthetic_capture):
    """A selection of Python lists once crashed fit (it wanted text, similarity lists)."""
    path, _ = synthetic_capture
    with open_capture(path) as cap:
        params = FitParams(ratios=[0.1], estimators=["topk"])
        by_list = fit(cap, Selection.of(cap, [1, 2], [0]), params)
        by_text = fit(cap, Selection.of(cap, "1,2", "0"), params)
    pd.testing.assert_frame_equal(by_list, by_text)
    assert set(by_list["learner"]) == {0} and set(by_list["step"]) == {1, 2}


def _defaults(command: str) -> dict:
    """The command line's default of each option of ``command``."""
    return {option.name: option.default for option in load_command(command).params}


def test_the_command_lines_defaults_are_the_params_defaults():
    """Each default is declared once (gradstat.defaults): the command line's options and
    the analyses' parameters start from the same values."""
    d = _defaults("fit")
    cli = FitParams(
        dists=d["dist"],
        method=d["method"],
        ratios=d["ratios"],
        stages=d["stages"],
        estimators=d["estimators"],
        hard_threshold=d["hard"],
        zeros=d["zeros"],
        stage_fit=d["stage_fit"],
        sample=d["sample"],
        seed=d["seed"],
    )
    assert cli == FitParams()
    d = _defaults("similarity")
    assert SimilarityParams(d["ratios"], d["on"]) == SimilarityParams()
    d = _defaults("buildup")
    assert BuildupParams(d["ratios"], d["on"]) == BuildupParams()
    d = _defaults("overlap")
    assert OverlapParams(d["ratios"], d["lag"], d["on"]) == OverlapParams()


def test_the_analyses_are_gradstats_own(synthetic_capture):
    """One shape, ``(cap, selection, params, *, compute, progress)``, importable from
    ``gradstat``; ratios in every parameters that take densities, one read for all."""
    assert gradstat.fit is fit and gradstat.overlap is overlap and gradstat.Selection is Selection
    assert gradstat.FitParams is FitParams and gradstat.Compute is Compute
    path, _ = synthetic_capture
    with open_capture(path) as cap:
        selection = gradstat.Selection.of(cap, steps=[0, 1, 2])
        two = gradstat.similarity(cap, selection, gradstat.SimilarityParams("0.01,0.1"))
        one = gradstat.similarity(cap, selection, gradstat.SimilarityParams(0.1))
        both = gradstat.overlap(cap, selection, gradstat.OverlapParams([0.01, 0.1]))
        alone = gradstat.overlap(cap, selection, gradstat.OverlapParams(0.1))
    assert list(dict.fromkeys(two.steps["ratio"])) == [0.01, 0.1]
    at = two.steps[two.steps["ratio"] == 0.1].reset_index(drop=True)
    pd.testing.assert_frame_equal(at, one.steps)
    assert list(dict.fromkeys(both["ratio"])) == [0.01, 0.1]
    pd.testing.assert_frame_equal(both[both["ratio"] == 0.1].reset_index(drop=True), alone)


def test_every_analysis_defaults_to_everything(synthetic_capture):
    path, _ = synthetic_capture
    with open_capture(path) as cap:
        assert set(similarity(cap).steps["step"]) == set(range(6))
        assert set(buildup(cap)["m"]) == {1, 2, 3}


def test_compute_validates_and_sizes_blocks():
    assert Compute().device == "auto"
    assert Compute(device="cpu").torch_device() == torch.device("cpu")
    with pytest.raises(UsageError, match="device='tpu'"):
        Compute(device="tpu")
    with pytest.raises(UsageError, match="jobs=0"):
        Compute(jobs=0)
    small = Compute(memory=parse_bytes("16MiB"))
    assert small.block_numel(1000) == 1000
    assert small.block_numel(10**9) == (16 << 20) // (4 * ROWS_ALIVE) == (16 << 20) // 24
    large = Compute(memory=parse_bytes("64GiB"))  # six rows of 1B values would fit
    assert large.block_numel(MAX_BLOCK) == MAX_BLOCK == 16 << 20
    assert large.block_numel(10**9) == MAX_BLOCK
    assert parse_bytes("2GB") == 2 * 10**9 and parse_bytes("512MiB") == 512 << 20
    with pytest.raises(UsageError, match="--memory 'lots'"):
        parse_bytes("lots", "--memory")


@pytest.mark.parametrize("jobs", [None, pytest.param(2, marks=pytest.mark.slow)])
def test_progress_moves_once_a_step_whatever_the_units(synthetic_capture, jobs):
    """A unit is a run of steps (one per process); progress still counts each step once,
    in this process and in workers alike."""
    path, _ = synthetic_capture
    seen: list[int] = []

    def progress(parts):
        seen.append(len(parts))
        return parts

    with open_capture(path) as cap:
        selection = Selection.of(cap, steps=[0, 1, 2, 3, 4])
        params, compute = BuildupParams(0.1), Compute(device="cpu", jobs=jobs)
        records = buildup(cap, selection, params, compute=compute, progress=progress)
        fitted = fit(cap, selection, FitParams(ratios=0.1), compute=compute, progress=progress)
    assert seen == [5, 5]
    assert (
        list(dict.fromkeys(records["step"]))
        == list(dict.fromkeys(fitted["step"]))
        == [0, 1, 2, 3, 4]
    )
