"""Error-feedback-corrected vectors: what a top-k compressor with residual memory sees.

Replays residual error feedback (Stich et al. 2018; Karimireddy et al. 2019; docs/methods.md
4) with an exact top-k compressor over consecutive recorded steps: for each learner,
``p = memory.compensate(g)`` (p = g + m); ``c`` = top-k of ``p``; ``memory.update(p, c)``
(m = p - c); the analysis then looks at ``p`` (docs/methods.md 3, last point).

Each (scope, ratio) pair is its own compressor with its own memory, as a layer-wise or
model-wise top-k would be: the learners' memories are the rows of one ``[learners,
numel]`` tensor, updated learner by learner.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from gradstat.analysis.selection import k_for
from gradstat.errors import GradstatWarning
from gradstat.parallel.progress import Progress, no_progress
from gradstat.stats.topk_sets import topk_indices
from gradstat.store import Capture, Scope


def warn_gaps(steps: Sequence[int], what: str) -> None:
    """Warn (``GradstatWarning``) when error feedback walks ``steps`` (training steps)
    that are not consecutive: its memories then miss the gradients of the steps that
    were not recorded, and differ from training."""
    gaps = np.diff(np.asarray(steps, dtype=np.int64))
    if gaps.size and (gaps != 1).any():
        first = int(np.flatnonzero(gaps != 1)[0])
        warnings.warn(
            f"{what} runs error feedback over steps {steps[0]}..{steps[-1]}, but training "
            f"steps between them were not recorded ({int((gaps != 1).sum())} gap(s), gaps "
            f"up to {int(gaps.max())}, e.g. step {steps[first]} -> {steps[first + 1]}): "
            "the memories miss those gradients",
            GradstatWarning,
            stacklevel=3,
        )


def replay_steps(recorded: Sequence[int], selected: Sequence[int]) -> list[int]:
    """Recorded steps the replay must walk: from the first recorded to the last selected
    (:func:`warn_gaps` when they are not consecutive)."""
    last = max(int(s) for s in selected)
    walk = [int(s) for s in recorded if int(s) <= last]
    warn_gaps(walk, "--on ef")
    return walk


def ef_vectors(
    cap: Capture,
    steps: Sequence[int],
    learners: Sequence[int],
    scopes: Sequence[Scope],
    ratios: Sequence[float],
    progress: Progress = no_progress,
) -> Iterator[tuple[int, dict[tuple[str, float], torch.Tensor]]]:
    """Yield ``(step, {(scope name, ratio): p [learners, scope numel]})`` at ``steps``.

    The replay starts at the first recorded step (empty memories) and walks every
    recorded step up to the last of ``steps``; only the requested steps are yielded.
    """
    wanted = {int(s) for s in steps}
    memories = {
        (scope.name, ratio): torch.zeros(len(learners), scope.numel)
        for scope in scopes
        for ratio in ratios
    }
    walk = replay_steps(cap.steps, steps)
    for step in progress(walk):
        grads = cap.read_step(step, learners)
        out = {}
        for scope in scopes:
            g = scope.take(grads)
            for ratio in ratios:
                out[scope.name, ratio] = _corrected(memories[scope.name, ratio], g, ratio)
        if step in wanted:
            yield step, out


def _corrected(memory: torch.Tensor, g: torch.Tensor, ratio: float) -> torch.Tensor:
    """Every learner's ``p = g + m``, then ``m = p - topk(p)``: ``p`` with its top-k
    zeroed (``memory`` in place). Returns ``p[learners, numel]``."""
    p = g + memory
    memory.copy_(p).scatter_(1, topk_indices(p, k_for(ratio, g.shape[1])), 0.0)
    return p
