"""Error-feedback memories, kept apart from compressors (GRACE's Compressor / Memory split).

Residual error feedback (Stich et al. 2018; Karimireddy et al. 2019, METHODS.md 4):
``p = g + m``; ``c = C(p)``; ``m = p - c``. ScaleCom's low-pass variant (Chen et al.
2021, arXiv 2104.11125) keeps ``m = (1 - beta) m + beta (p - c)``; beta = 1 is plain EF.
"""

from __future__ import annotations

import torch


class ResidualMemory:
    """Per-learner residual memory ``m`` with optional low-pass factor ``beta``."""

    def __init__(self, beta: float = 1.0) -> None:
        if not 0.0 < beta <= 1.0:
            raise ValueError(f"beta must be in (0, 1], got {beta}")
        self.beta = beta
        self.memory: torch.Tensor | None = None

    def compensate(self, grad: torch.Tensor) -> torch.Tensor:
        """The corrected vector ``p = g + m`` that the compressor sees."""
        if self.memory is None:
            self.memory = torch.zeros_like(grad)
        return grad + self.memory

    def update(self, corrected: torch.Tensor, sent: torch.Tensor) -> None:
        """Keep what was not sent: ``m = (1 - beta) m + beta (p - c)``."""
        residual = corrected - sent
        if self.beta == 1.0 or self.memory is None:
            self.memory = residual
        else:
            self.memory.mul_(1.0 - self.beta).add_(residual, alpha=self.beta)

    def reset(self) -> None:
        self.memory = None
