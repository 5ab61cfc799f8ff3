"""Error-feedback memories, kept apart from compressors (GRACE's Compressor / Memory split).

Every memory holds one row per learner: it is fed the step's gradients ``g[n, d]`` and
hands the compressor the corrected vectors ``p[n, d]``; after the exchange it keeps what
was not sent.

* Residual error feedback (Stich et al. 2018; Karimireddy et al. 2019, docs/methods.md 4):
  ``p = g + m``; ``c = C(p)``; ``m = p - c``. ScaleCom's low-pass variant (Chen et al.
  2021, arXiv 2104.11125) keeps ``m = (1 - beta) m + beta (p - c)``; beta = 1 is plain EF.
* DGC momentum correction with factor masking (Lin et al. 2018, arXiv 1712.01887):
  ``u = mu u + g``; ``v = v + u``; the compressor sees ``v``; ``u`` and ``v`` are zeroed
  where something was sent.
* No memory: the compressor sees ``g`` (unbiased quantisers, casts).
"""

from __future__ import annotations

import torch


def _row_norm(memory: torch.Tensor | None) -> float:
    """Mean over learners of ``||m_i||_2`` (0 before the first step)."""
    if memory is None:
        return 0.0
    return float(torch.linalg.vector_norm(memory.double(), dim=-1).mean())


class NoMemory:
    """No error feedback: ``p = g``, nothing is kept."""

    def compensate(self, grad: torch.Tensor) -> torch.Tensor:
        return grad

    def update(self, corrected: torch.Tensor, sent: torch.Tensor) -> None:
        """Nothing to keep."""

    def norm(self) -> float:
        return 0.0

    def reset(self) -> None:
        """Nothing to forget."""


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

    def norm(self) -> float:
        """Mean over learners of ``||m_i||_2``."""
        return _row_norm(self.memory)

    def reset(self) -> None:
        self.memory = None


class DGCMemory:
    """DGC's momentum correction ``u`` and accumulation ``v`` with factor masking.

    The compressor selects from ``v``; after the exchange ``u`` and ``v`` are zeroed at
    the coordinates that were sent (``sent != 0``), so momentum of sent coordinates does
    not keep pushing stale values (Lin et al. 2018, section 3.2).
    """

    def __init__(self, momentum: float = 0.9) -> None:
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.momentum = momentum
        self.velocity: torch.Tensor | None = None
        self.accumulated: torch.Tensor | None = None

    def compensate(self, grad: torch.Tensor) -> torch.Tensor:
        """``u = mu u + g``; ``v = v + u``; returns ``v``."""
        if self.velocity is None or self.accumulated is None:
            self.velocity = grad.clone()
            self.accumulated = grad.clone()
        else:
            self.velocity.mul_(self.momentum).add_(grad)
            self.accumulated.add_(self.velocity)
        return self.accumulated

    def update(self, corrected: torch.Tensor, sent: torch.Tensor) -> None:
        """``v = v - c`` and zero ``u`` and ``v`` where ``c`` is non-zero."""
        assert self.velocity is not None and self.accumulated is not None
        mask = sent != 0
        self.accumulated = corrected - sent
        self.accumulated.masked_fill_(mask, 0.0)
        self.velocity.masked_fill_(mask, 0.0)

    def norm(self) -> float:
        """Mean over learners of ``||v_i||_2`` (what is still waiting to be sent)."""
        return _row_norm(self.accumulated)

    def reset(self) -> None:
        self.velocity = None
        self.accumulated = None


Memory = NoMemory | ResidualMemory | DGCMemory
