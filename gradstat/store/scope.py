"""Scopes: which part of the flat gradient vector an analysis looks at.

``model`` is the whole vector (how SIDCo and most compressors see it), ``layers`` is one
scope per parameter, and any other text is a regular expression over layer names whose
matches are concatenated into one scope.

Python's ``re`` backtracks: a pattern such as ``(.*.*)*X$`` takes exponential time on a
name that does not match (44 s at 16 characters), and no timeout exists for it. So a
pattern is matched against the names once per process in a forked child with a time
limit (:func:`gradstat.store.guard.bounded`, ``MATCH_SECONDS``); one that does not
finish is refused with one line, and the answer is kept for the process's later calls.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gradstat.errors import DataError, UsageError
from gradstat.store.guard import bounded
from gradstat.store.schema import Layer

#: Seconds a layer-name pattern may take over every name of a capture.
MATCH_SECONDS = 2.0

if TYPE_CHECKING:  # torch loads on first use: `gradstat info` and --help never need it
    import torch


@dataclass(frozen=True)
class Scope:
    """A named set of ``(offset, numel)`` slices of the flat gradient vector."""

    name: str
    slices: tuple[tuple[int, int], ...]

    @property
    def numel(self) -> int:
        return sum(numel for _, numel in self.slices)

    def take(self, grads: torch.Tensor) -> torch.Tensor:
        """The scope's columns of ``grads[..., numel]``: a view when contiguous."""
        if len(self.slices) == 1:
            offset, numel = self.slices[0]
            return grads[..., offset : offset + numel]
        import torch

        return torch.cat([grads[..., o : o + n] for o, n in self.slices], dim=-1)


def _merge(layers: Sequence[Layer]) -> tuple[tuple[int, int], ...]:
    """Merge adjacent layer slices so that a contiguous run is read as one view."""
    merged: list[list[int]] = []
    for layer in layers:
        if merged and merged[-1][0] + merged[-1][1] == layer.offset:
            merged[-1][1] += layer.numel
        else:
            merged.append([layer.offset, layer.numel])
    return tuple((o, n) for o, n in merged)


def resolve_scopes(layers: Sequence[Layer], spec: str = "model") -> list[Scope]:
    """Turn ``model`` / ``layers`` / a layer-name regex into scopes."""
    if not layers:
        raise UsageError("the capture has no layers")
    if spec == "model":
        return [Scope("model", _merge(layers))]
    if spec == "layers":
        return [Scope(layer.name, ((layer.offset, layer.numel),)) for layer in layers]
    try:
        re.compile(spec)
    except re.error as exc:
        raise UsageError(
            f"scope={spec!r} is not 'model', 'layers' or a valid regex: {exc}"
        ) from None
    chosen = set(matching(spec, tuple(layer.name for layer in layers), "scope="))
    matched = [layer for i, layer in enumerate(layers) if i in chosen]
    if not matched:
        names = ", ".join(layer.name for layer in layers[:6])
        raise UsageError(f"scope={spec!r} matches no layer (layers: {names}, ...)")
    return [Scope(spec, _merge(matched))]


@functools.lru_cache(maxsize=64)
def matching(pattern: str, names: tuple[str, ...], option: str = "scope=") -> tuple[int, ...]:
    """Indices of the ``names`` that ``pattern`` finds (``re.search``), computed within
    ``MATCH_SECONDS`` (see the module docstring); ``option`` names the pattern in the
    ``UsageError`` of one that takes longer."""
    try:
        return bounded(_search, pattern, names, timeout=MATCH_SECONDS)
    except DataError:
        raise UsageError(
            f"{option}{pattern!r} did not finish matching {len(names)} layer names within "
            f"{MATCH_SECONDS:g} s: a pattern that backtracks (nested repeats such as "
            "(a*)* or (.*.*)*) takes exponential time; simplify it"
        ) from None


def _search(pattern: str, names: tuple[str, ...]) -> tuple[int, ...]:
    regex = re.compile(pattern)
    return tuple(i for i, name in enumerate(names) if regex.search(name))
