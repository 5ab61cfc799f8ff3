"""``gradstat noise``: B_simple and its interval against known truths and plain numpy."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats

from gradstat.analysis.compute import MIN_MEMORY, Compute
from gradstat.analysis.gram import Grams, plan_blocks
from gradstat.analysis.noise import NoiseParams, noise, noise_summary
from gradstat.analysis.selection import Selection
from gradstat.errors import UsageError
from gradstat.store import layer_table, open_capture, write_capture
from tests.helpers import assert_clean_error, run_cli


def _known(tmp_path, name, n, steps, d, b, sigma, signal, seed=0):
    """Learners' gradients g_i = G + noise of variance sigma^2 / b per element (each
    step a fresh draw): the truth is B_simple = d sigma^2 / |G|^2."""
    rng = np.random.default_rng(seed)
    g = rng.standard_normal(d)
    g *= signal / np.linalg.norm(g)
    grads = g + rng.standard_normal((n, steps, d)) * sigma / math.sqrt(b)
    layers = layer_table([("w", (d,))])
    path = write_capture(tmp_path / name, grads.astype(np.float32), layers, meta={"batch_size": b})
    return path, d * sigma**2 / signal**2, signal**2, d * sigma**2


@pytest.mark.parametrize(("signal", "name"), [(20.0, "signal"), (3.0, "noisy")])
def test_interval_holds_the_true_noise_scale_in_90_percent_of_seeds(tmp_path, signal, name):
    """120 independent draws (one per step) of 8 learners at B_simple 2.5 and 111: the
    95% interval holds the truth in at least 90% of them, and the estimates are unbiased."""
    path, truth, g2, trace = _known(tmp_path, name, 8, 120, 1000, 16, 1.0, signal)
    with open_capture(path) as cap:
        steps = noise(cap).steps
    held = (steps["ci_low"] <= truth) & (truth <= steps["ci_high"])
    assert held.mean() >= 0.9, held.mean()
    for column, expected in (("g2", g2), ("trace", trace)):
        values = steps[column]
        error = values.std() / math.sqrt(len(values))
        assert abs(values.mean() - expected) < 4 * error, (column, values.mean(), expected)


def _plain_noise(rows: np.ndarray, b: int) -> dict:
    """McCandlish et al.'s estimates from the learners' rows, as the paper writes them."""
    n = len(rows)
    small = float(np.mean((rows**2).sum(axis=1)))
    big = float((rows.mean(axis=0) ** 2).sum())
    g2 = (n * b * big - b * small) / (n * b - b)
    trace = (small - big) / (1 / b - 1 / (n * b))
    return {"g_small2": small, "g_big2": big, "g2": g2, "trace": trace, "noise": trace / b}


def test_every_field_equals_plain_numpy_on_a_real_capture(real_capture):
    with open_capture(real_capture) as cap, pytest.warns(UserWarning, match="too few"):
        result = noise(cap, params=NoiseParams(window=3))
        b = cap.batch_size
        expected = [_plain_noise(cap.read_step(s).double().numpy(), b) for s in cap.steps]
    steps = result.steps
    assert b == 32 and result.batch_size == 32 and list(steps["step"]) == list(cap.steps)
    for column in ("g_small2", "g_big2", "g2", "trace", "noise"):
        np.testing.assert_allclose(steps[column], [e[column] for e in expected], rtol=1e-6)
    plain = [e["trace"] / e["g2"] if e["g2"] > 0 else math.inf for e in expected]
    np.testing.assert_allclose(steps["b_simple"], plain, rtol=1e-6)
    for i in range(len(expected)):  # the ratio of the last 3 steps' means
        window = expected[max(0, i - 2) : i + 1]
        g2 = np.mean([e["g2"] for e in window])
        ratio = np.mean([e["trace"] for e in window]) / g2 if g2 > 0 else math.inf
        np.testing.assert_allclose(steps["b_simple_avg"].iloc[i], ratio, rtol=1e-6)
    assert steps["ci_low"].isna().all() and steps["ci_high"].isna().all()  # 3 learners
    summary = noise_summary(result).iloc[0]
    mean_trace, mean_g2 = (
        np.mean([e["trace"] for e in expected]),
        np.mean([e["g2"] for e in expected]),
    )
    np.testing.assert_allclose(summary["b_simple"], mean_trace / mean_g2, rtol=1e-6)


def _plain_interval(rows: np.ndarray, b: int, counts: np.ndarray, confidence: float):
    """The interval from explicitly resampled rows: for each resample, the mean of
    g_a . g_b over pairs of resampled positions from different learners, over the mean
    of (||g_a||^2 + ||g_b||^2) / 2 over the same pairs; Hesterberg's expanded levels."""
    n = len(rows)
    shares = []
    for count in counts:
        picked = [i for i in range(n) for _ in range(int(count[i]))]
        cross, norms, pairs = 0.0, 0.0, 0
        for a, i in enumerate(picked):
            for c, j in enumerate(picked):
                if a != c and i != j:
                    cross += rows[i] @ rows[j]
                    norms += (rows[i] @ rows[i] + rows[j] @ rows[j]) / 2
                    pairs += 1
        if pairs:
            shares.append(cross / norms)
    level = stats.norm.sf(math.sqrt(n / (n - 1)) * stats.t.ppf((1 + confidence) / 2, n - 1))
    low, high = np.quantile(shares, [level, 1 - level])
    return b * (1 / high - 1), b * (1 / low - 1) if low > 0 else math.inf


def test_interval_equals_a_plain_resampling_loop(tmp_path):
    path, *_ = _known(tmp_path, "five", 5, 3, 300, 8, 1.0, 4.0)
    params = NoiseParams(resamples=200, confidence=0.9, seed=7)
    with open_capture(path) as cap:
        steps = noise(cap, params=params).steps
        for k, step in enumerate(cap.steps):
            rows = cap.read_step(step).double().numpy()
            rng = np.random.default_rng([7, int(step), 0])  # the analysis's draw
            counts = rng.multinomial(5, np.full(5, 0.2), size=200)
            low, high = _plain_interval(rows, 8, counts, 0.9)
            np.testing.assert_allclose(steps[["ci_low", "ci_high"]].iloc[k], [low, high], rtol=1e-6)


def test_identical_learners_have_no_sampling_noise(tmp_path):
    rng = np.random.default_rng(3)
    grads = np.repeat(rng.standard_normal((1, 2, 500)), 4, axis=0).astype(np.float32)
    path = write_capture(tmp_path / "same", grads, layer_table([("w", (500,))]))
    with open_capture(path) as cap:
        steps = noise(cap, params=NoiseParams(batch_size=4)).steps
    np.testing.assert_allclose(steps["trace"], 0, atol=1e-9 * steps["g2"].max())
    np.testing.assert_allclose(steps[["b_simple", "ci_low", "ci_high"]], 0, atol=1e-6)


def test_column_blocks_and_scopes_give_each_scope_its_gram(tmp_path):
    """Rows longer than a block, a layer scope per layer and a regex scope with a gap:
    each Gram equals numpy's, from blocks that cover every scope column once, and is
    the same to the bit as the Gram of one block per row (``--memory``, ``--jobs``)."""
    rng = np.random.default_rng(4)
    layers = layer_table([("a.w", (300, 200)), ("b.w", (7,)), ("a.b", (50_000,)), ("c", (9,))])
    grads = rng.standard_normal((3, 1, layers[-1].stop)).astype(np.float32)
    path = write_capture(tmp_path / "wide", grads, layers)
    rows = grads[:, 0].astype(np.float64)
    compute = Compute("cpu", memory=MIN_MEMORY)  # blocks of 43,008 columns
    with open_capture(path) as cap:
        for spec in ("model", "layers", r"^a\."):
            scopes = cap.scopes(spec)
            blocks = plan_blocks(scopes, 43_690)
            covered = [(b.start + lo, b.start + hi, k) for b in blocks for k, lo, hi in b.pieces]
            for k, sc in enumerate(scopes):
                mine = sorted((lo, hi) for lo, hi, j in covered if j == k)
                columns = np.concatenate([np.arange(lo, hi) for lo, hi in mine])
                expected = np.concatenate([np.arange(o, o + n) for o, n in sc.slices])
                assert np.array_equal(columns, expected), (spec, sc.name)
            grams = Grams(cap, [0, 1, 2], scopes, compute, "a test").step(0)
            whole = Grams(cap, [0, 1, 2], scopes, Compute("cpu"), "a test").step(0)
            for sc, gram, one_block in zip(scopes, grams, whole, strict=True):
                assert np.array_equal(gram, one_block), (spec, sc.name)
                x = np.concatenate([rows[:, o : o + n] for o, n in sc.slices], axis=1)
                expected = x @ x.T  # unrelated rows: off the diagonal, float32's rounding
                np.testing.assert_allclose(gram, expected, atol=1e-7 * expected.max())
                assert np.array_equal(gram, gram.T)


def test_a_compressor_error_against_the_sampling_noise(tmp_path, capsys):
    path, *_ = _known(tmp_path, "cmp", 4, 2, 1000, 8, 1.0, 5.0)
    result = run_cli(capsys, "noise", path, "--compressors", "topk", "--ratios", "0.1", "--json")
    assert result.code == 0, result.stderr
    document = json.loads(result.stdout)
    record = document["records"][0]
    for field in ("step", "scope", "g2", "trace", "b_simple", "ci_low", "ci_high"):
        assert field in record
    with open_capture(path) as cap:
        rows = cap.read_step(0).double().numpy()
    dropped = np.sort(rows**2, axis=1)[:, :-100].sum(axis=1)  # all but the top 100 |g|
    row = document["compressors"][0]
    assert row["compressor"] == "topk" and row["ratio"] == 0.1
    np.testing.assert_allclose(row["error"], dropped.mean(), rtol=1e-6)
    np.testing.assert_allclose(row["noise_ratio"], dropped.mean() / record["noise"], rtol=1e-6)


def test_compressors_without_a_per_learner_form_are_refused(tmp_path, capsys):
    path, *_ = _known(tmp_path, "cltk", 4, 1, 400, 8, 1.0, 5.0)
    result = run_cli(capsys, "noise", path, "--compressors", "clt-k", "--ratios", "0.1")
    assert_clean_error(result, 2)
    assert "clt-k compresses with every learner at once" in result.stderr


def test_the_batch_size_comes_from_the_capture_or_the_option(tmp_path, capsys):
    grads = np.random.default_rng(5).standard_normal((3, 2, 60)).astype(np.float32)
    path = write_capture(tmp_path / "nobatch", grads, layer_table([("w", (60,))]))
    result = run_cli(capsys, "noise", path)
    assert_clean_error(result, 2)
    assert "does not record the per-learner batch size" in result.stderr
    assert "--batch-size" in result.stderr
    result = run_cli(capsys, "noise", path, "--batch-size", "16", "--json")
    assert result.code == 0 and json.loads(result.stdout)["records"][0]["batch_size"] == 16
    recorded = write_capture(
        tmp_path / "b8", grads, layer_table([("w", (60,))]), meta={"batch_size": 8}
    )
    result = run_cli(capsys, "noise", recorded, "--batch-size", "16", "--json")
    assert result.code == 0 and "recorded 8; using 16" in " ".join(result.stderr.split())
    bad = write_capture(
        tmp_path / "bad", grads, layer_table([("w", (60,))]), meta={"batch_size": -3}
    )
    result = run_cli(capsys, "noise", bad)
    assert_clean_error(result, 1)
    assert "batch_size -3 is not a positive integer" in result.stderr
    with open_capture(path) as cap, pytest.raises(UsageError, match="at least 2"):
        noise(cap, Selection.of(cap, learners=[0]), NoiseParams(batch_size=4))


def test_non_finite_gradients_are_an_error_naming_step_and_learner(tmp_path, capsys):
    grads = np.ones((3, 3, 50), dtype=np.float32)
    grads[2, 1, 7] = np.nan
    path = write_capture(tmp_path / "nan", grads, layer_table([("w", (50,))]))
    for command in ("noise", "consistency"):
        result = run_cli(
            capsys, command, path, *(["--batch-size", "4"] if command == "noise" else [])
        )
        assert_clean_error(result, 1)
        assert "step 1, learner 2: 1 NaN/Inf" in result.stderr


def test_a_layer_without_gradient_has_no_noise_scale_and_no_numpy_warning(tmp_path):
    """A frozen or unused layer (every learner's gradient 0): NaN, not inf, not a warning."""
    rng = np.random.default_rng(6)
    grads = rng.standard_normal((4, 2, 30)).astype(np.float32)
    grads[:, :, 20:] = 0
    layers = layer_table([("used", (20,)), ("unused", (10,))])
    path = write_capture(tmp_path / "zero", grads, layers, meta={"batch_size": 4})
    import warnings

    from gradstat.analysis.consistency import consistency

    with open_capture(path) as cap, warnings.catch_warnings():
        warnings.simplefilter("error")
        steps = noise(cap, Selection.of(cap, scope="layers")).steps
        agree = consistency(cap, Selection.of(cap, scope="layers")).steps
    unused = steps[steps["scope"] == "unused"]
    assert unused[["b_simple", "ci_low", "ci_high"]].isna().all().all()
    assert agree[agree["scope"] == "unused"][["cosine_mean", "diversity"]].isna().all().all()
    assert steps[steps["scope"] == "used"]["b_simple"].notna().all()
