"""Number formatting shared by the terminal tables and the HTML report."""

from __future__ import annotations

import math

import numpy as np


def format_cell(value) -> str:
    """4 significant digits; scientific notation outside [1e-3, 1e5); dicts as k=v."""
    if isinstance(value, (float, np.floating)):
        if not math.isfinite(value):
            return str(value)
        if value == 0 or 1e-3 <= abs(value) < 1e5:
            return f"{value:.4g}"
        return f"{value:.3e}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={format_cell(v)}" for k, v in value.items())
    return str(value)
