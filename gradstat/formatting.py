"""Number formatting shared by the terminal tables and the HTML report.

One rule everywhere: 4 significant digits (whole numbers from 1e4 to 1e7), scientific
notation only outside [1e-3, 1e7), ``-`` for a missing value (NaN, None), ``yes`` and
``no`` for booleans.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

#: What a missing value (NaN, None, pandas NA) shows as.
MISSING = "-"


def counted(n: int, noun: str) -> str:
    """``1 learner``, ``4 learners``: a count and its noun in the right number."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def format_cell(value) -> str:
    """4 significant digits below 1e4, whole numbers up to 1e7, scientific notation
    outside [1e-3, 1e7); dicts as k=v."""
    if value is None:
        return MISSING
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if isinstance(value, (float, np.floating)):
        if math.isnan(value):
            return MISSING
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if value == 0 or 1e-3 <= abs(value) < 1e4:
            return f"{value:.4g}"
        if 1e4 <= abs(value) < 1e7:  # bytes, counts: whole numbers read better
            return f"{value:.0f}"
        return f"{value:.3e}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={format_cell(v)}" for k, v in value.items())
    if value is pd.NA or value is pd.NaT:
        return MISSING
    return str(value)
