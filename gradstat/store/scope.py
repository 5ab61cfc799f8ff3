"""Scopes: which part of the flat gradient vector an analysis looks at.

``model`` is the whole vector (how SIDCo and most compressors see it), ``layers`` is one
scope per parameter, and any other text is a regular expression over layer names whose
matches are concatenated into one scope.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gradstat.errors import UsageError
from gradstat.store.schema import Layer

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
        pattern = re.compile(spec)
    except re.error as exc:
        raise UsageError(
            f"scope={spec!r} is not 'model', 'layers' or a valid regex: {exc}"
        ) from None
    matched = [layer for layer in layers if pattern.search(layer.name)]
    if not matched:
        names = ", ".join(layer.name for layer in layers[:6])
        raise UsageError(f"scope={spec!r} matches no layer (layers: {names}, ...)")
    return [Scope(spec, _merge(matched))]
