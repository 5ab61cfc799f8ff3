"""How many elements a density keeps: one rule for every analysis and compressor."""

from __future__ import annotations

from gradstat.errors import DataError, UsageError


def k_for(ratio: float, numel: int) -> int:
    """Number of elements a density keeps: ``max(1, round(ratio * numel))``."""
    return max(1, round(ratio * numel))


def check_k(k: int, nonzeros: int) -> None:
    """Raise unless ``k`` of the ``nonzeros`` non-zero values can be selected."""
    if nonzeros == 0:
        raise DataError("all values are exactly zero: nothing to select")
    if k > nonzeros:
        raise UsageError(
            f"k = {k} is larger than the {nonzeros} non-zero values; use a smaller ratio"
        )
