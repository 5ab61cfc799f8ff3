"""The answer of each analysis in a sentence or two, from its summary table.

Shared by the terminal (the ``answer`` panel under each command's summary) and the
report's summary box, so both say the same thing about the same numbers.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

#: Estimators that hit k by construction (a sort), left out of "closest to k".
EXACT = {"topk"}
#: Estimators that fall back to an exact top-k when their estimate selects too many
#: (DGC: over 1.3 k sampled candidates), so q = 1 there is the fallback, not an estimate:
#: ranked apart, with a sentence saying so where their median q is exactly 1.
FALLBACK = {"dgc"}


def _ratio_text(ratio: float) -> str:
    return f"{ratio:g}"


def best_fit(ranking: pd.DataFrame) -> str:
    """``gpd fits |g| best (median KS 0.042; next lognormal, 0.053).``"""
    if ranking.empty:
        return "No distribution could be fitted."
    best = ranking.iloc[0]
    text = f"{best['dist']} fits |g| best (median KS {best['ks']:.3g}"
    if len(ranking) > 1:
        runner = ranking.iloc[1]
        text += f"; next {runner['dist']}, {runner['ks']:.3g}"
    return text + ")."


def closest_estimators(quality: pd.DataFrame, notes: bool = True) -> list[str]:
    """Per ratio, the estimator whose median q = selected / k is closest to 1 (on a log
    scale, so q = 2 and q = 0.5 are equally far), with its range over records, among the
    estimators that estimate (exact top-k and DGC's exact fallback aside); then, where
    DGC's median q is exactly 1 (with ``notes``), that it fell back to exact top-k."""
    kinds = quality["estimator"]
    estimating = ~kinds.isin(EXACT | FALLBACK) & ~kinds.str.startswith("fit:")
    lines = []
    for ratio, group in quality[estimating].groupby("ratio", sort=False):
        distance = np.abs(np.log(group["q median"].clip(lower=1e-12)))
        best = group.loc[distance.idxmin()]
        stages = "" if best["stages"] in ("1", 1) else f", {best['stages']} stages"
        lines.append(
            f"At ratio {_ratio_text(ratio)}, {best['estimator']}{stages} comes closest to k "
            f"among the estimators that estimate: median q {best['q median']:.3g} "
            f"(range {best['q min']:.3g} to {best['q max']:.3g})."
        )
    fallback = quality[kinds.isin(FALLBACK)] if notes else quality.iloc[:0]
    for name, rows in fallback.groupby("estimator", sort=False):
        exact = [
            _ratio_text(r) for r, q in zip(rows["ratio"], rows["q median"], strict=True) if q == 1
        ]
        if exact:
            at = f"ratio {exact[0]}" if len(exact) == 1 else f"ratios {', '.join(exact)}"
            lines.append(
                f"At {at}, {name}'s median q of 1 is its exact top-k fallback (its sampled "
                "threshold selected over 1.3 k), not an estimate."
            )
    return lines


def similarity_answer(summary: pd.DataFrame) -> list[str]:
    """How much two learners' top-k sets share, against random sets."""
    lines = []
    for row in summary.to_dict(orient="records"):
        lines.append(
            f"At ratio {_ratio_text(row['ratio'])}, two learners' top-k sets share "
            f"{row['mean_overlap']:.0%} of their indices ({row['overlap_vs_random']:.0f}x "
            f"random sets) and a learner's set holds {row['mean_overlap_global']:.0%} of the "
            "mean gradient's top-k."
        )
    return lines


def buildup_answer(summary: pd.DataFrame) -> list[str]:
    """The union of all learners' top-k against k, against random, against dense."""
    n = int(summary["m"].max())
    full = summary[summary["m"] == n]
    return [
        f"At ratio {_ratio_text(row['ratio'])}, the union of {n} learners' top-k sets is "
        f"{row['buildup']:.2f}x k (random sets: {row['random_buildup']:.2f}x); an all-gather "
        f"moves {row['allgather_vs_allreduce']:.2g} of a dense all-reduce's bytes."
        for row in full.to_dict(orient="records")
    ]


def overlap_answer(summary: pd.DataFrame) -> list[str]:
    """How much of its top-k a learner and the mean gradient keep from step to step."""
    lines = []
    for (_, ratio), group in summary.groupby(["scope", "ratio"], sort=False):
        learners = group[group["learner"].astype(str) != "mean"]
        mean = group[group["learner"].astype(str) == "mean"]
        text = (
            f"At ratio {_ratio_text(ratio)}, a learner keeps {learners['mean_overlap'].mean():.0%}"
            " of its top-k indices from one recorded step to the next"
        )
        if len(mean):
            text += f", the mean gradient {mean['mean_overlap'].iloc[0]:.0%}"
        lines.append(text + f" (random sets: {group['random_overlap'].iloc[0]:.2%}).")
    return lines


def _label(row: dict) -> str:
    ratio = row.get("ratio")
    fixed = ratio is None or (isinstance(ratio, float) and math.isnan(ratio))
    return row["compressor"] if fixed else f"{row['compressor']} at {ratio:g}"


def replay_answer(summary: pd.DataFrame) -> list[str]:
    """The most accurate and the fastest compressor of a replay."""
    best = summary.sort_values("rel_error").iloc[0].to_dict()
    fastest = summary.sort_values("seconds").iloc[0].to_dict()
    return [
        f"Smallest mean relative error: {_label(best)} ({best['rel_error']:.3g}).",
        f"Fastest predicted step: {_label(fastest)} ({fastest['seconds'] * 1e3:.3g} ms: "
        f"communication + compression).",
    ]


def _samples(value: float) -> str:
    return "infinite" if math.isinf(value) else f"{value:.3g} samples"


def noise_answer(summary: pd.DataFrame, compressors: pd.DataFrame | None = None) -> list[str]:
    """B_simple against the batch the learners make together, and each compressor's
    error against the sampling noise (``noise_summary``, ``compressor_summary``)."""
    lines = []
    if len(summary) > 1:
        order = summary.sort_values("b_simple")
        low, high = order.iloc[0], order.iloc[-1]
        unmeasured = int(np.isinf(summary["b_simple"]).sum())
        lines.append(
            f"B_simple over {len(summary)} scopes ranges from {_samples(low['b_simple'])} "
            f"({low['scope']}) to {_samples(high['b_simple'])} ({high['scope']})"
            + (f"; {unmeasured} scope(s) measured no signal (|G|^2 <= 0)." if unmeasured else ".")
        )
    else:
        row = summary.iloc[0]
        n, b = int(row["learners"]), int(row["batch_size"])
        if np.isinf(row["b_simple"]):
            return [
                f"B_simple is infinite: the mean |G|^2 over {int(row['steps'])} steps is not "
                f"positive, so {n} learners measure no signal in the noise.",
                *_noise_lines(compressors),
            ]
        text = (
            f"B_simple = {_samples(row['b_simple'])} (mean tr(Sigma) / mean |G|^2 over "
            f"{int(row['steps'])} steps; per step median {row['step_median']:.3g}"
        )
        if np.isfinite(row["ci_low"]):
            high = f"{row['ci_high']:.3g}" if np.isfinite(row["ci_high"]) else "no upper end"
            text += f", median interval {row['ci_low']:.3g} to {high}"
        lines.append(text + ").")
        if np.isfinite(row["b_simple"]) and row["b_simple"] > 0:
            together = n * b
            steps = 1 + row["b_simple"] / together  # McCandlish et al.: S / S_min
            cut = 1 - (1 + row["b_simple"] / (2 * together)) / steps
            lines.append(
                f"The {n} learners' all-reduced batch of {together} is "
                f"{together / row['b_simple']:.2g}x B_simple; the steps to a given loss "
                f"scale as 1 + B_simple / B (McCandlish et al.), so twice the learners would "
                f"need {cut:.0%} fewer steps."
            )
    return lines + _noise_lines(compressors)


def _noise_lines(compressors: pd.DataFrame | None) -> list[str]:
    """Each compressor's error against the noise: one line per compressor and ratio."""
    lines: list[str] = []
    compressors = compressors if compressors is not None else pd.DataFrame()
    if len(compressors) and compressors["scope"].nunique() > 1:
        return _noise_per_scope(compressors)
    for row in compressors.to_dict("records"):
        ratio = row["noise_ratio"]
        verdict = "within" if ratio < 1 else "above"
        lines.append(
            f"{_label(row)}: error {ratio:.3g}x the sampling noise, {verdict} it on "
            f"average ({row['within_noise']:.0%} of steps within)."
        )
    return lines


def _noise_per_scope(compressors: pd.DataFrame) -> list[str]:
    """One line per compressor and ratio over several scopes: in how many its error is
    within the noise on average, and the range of its noise ratios."""
    lines = []
    keys = ["compressor", "ratio"]
    for _, group in compressors.groupby(keys, sort=False, dropna=False):
        row = group.iloc[0].to_dict()
        within = int((group["noise_ratio"] < 1).sum())
        low, high = group["noise_ratio"].min(), group["noise_ratio"].max()
        lines.append(
            f"{_label(row)}: error within the sampling noise on average in {within} of "
            f"{len(group)} scopes (error / noise {low:.3g} to {high:.3g})."
        )
    return lines


#: The consistency measures as a sentence names them.
MEASURE_NAMES = {
    "cosine_mean": "mean cosine",
    "cosine_min": "lowest cosine",
    "norm_cv": "gradient-norm CV",
    "loss_cv": "loss CV",
    "diversity": "gradient diversity",
}


def consistency_answer(
    summary: pd.DataFrame, correlations: pd.DataFrame | None = None
) -> list[str]:
    """How much the learners agree, how it moved, and what a compressor's error follows
    (``consistency_summary``, ``ConsistencyResult.correlations``)."""
    lines = []
    for row in summary.to_dict("records"):
        loss = "-" if not np.isfinite(row["loss_cv"]) else f"{row['loss_cv']:.2%}"
        lines.append(
            f"{row['scope']}: mean pairwise cosine {row['cosine_mean']:.3g} (lowest "
            f"{row['cosine_min']:.3g}; {row['cosine_first']:.3g} at the first step, "
            f"{row['cosine_last']:.3g} at the last); gradient-norm CV "
            f"{row['norm_cv']:.2%}, loss CV {loss}; diversity {row['diversity']:.3g} "
            f"(1/n = {1 / row['learners']:.3g} for identical learners, about 1 for "
            "unrelated ones)."
        )
    if correlations is None or correlations.empty:
        return lines
    found = correlations.dropna(subset=["rho"])
    for _, group in found.groupby(["scope", "compressor", "ratio"], sort=False, dropna=False):
        row = group.loc[group["rho"].abs().idxmax()].to_dict()
        strength = "significant at 5%" if row["p_value"] < 0.05 else "not significant at 5%"
        lines.append(
            f"{_label(row)}: its error moves most with the {MEASURE_NAMES[row['measure']]} "
            f"(Spearman rho {row['rho']:.2f} over {int(row['steps'])} steps, p "
            f"{row['p_value']:.2g}: {strength})."
        )
    return lines
