"""PowerSGD: rank-r power iteration per matrix with a warm-started Q.

Vogels, Karimireddy and Jaggi 2019 (arXiv 1905.13727), Algorithm 1, as in PyTorch's
``powerSGD_hook`` (docs/methods.md 4): each >= 2-D parameter is viewed as a matrix
``M`` of shape ``(shape[0], prod(shape[1:]))``; ``P = M Q``; all-reduce ``P``;
orthogonalise it; ``Q = M^T P``; all-reduce ``Q``; every learner ends with
``M_hat = P Q^T`` (the same for all), and error feedback keeps ``M_i - M_hat``. ``Q``
starts from a seeded normal draw shared by all learners and is reused the next step
(warm start). A matrix is compressed only if ``(a + b) r < a b / 2``; vectors and small
matrices travel uncompressed in the first all-reduce and keep no error-feedback residual
(each learner sent exactly its own values, as in PyTorch's hook and GRACE). Its rate is
set by the rank, not by ``--ratios``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from gradstat.compressors.legacy import Compressor, Exchange, Transfer


class PowerSGD(Compressor):
    """Rank-``rank`` PowerSGD over the parameters ``shapes`` that tile the flat vector."""

    name = "powersgd"
    collective = "allreduce"

    def __init__(self, shapes: Sequence[tuple[int, ...]], rank: int = 4, seed: int = 0) -> None:
        if rank < 1:
            raise ValueError(f"powersgd rank must be >= 1, got {rank}")
        self.rank = rank
        self.seed = seed
        self.matrices: list[tuple[int, int, int]] = []  # (offset, rows, cols)
        self.dense: list[tuple[int, int]] = []  # (offset, numel)
        offset = 0
        for shape in shapes:
            numel = math.prod(shape)
            if len(shape) >= 2:
                rows, cols = shape[0], numel // shape[0]
                if (rows + cols) * rank < rows * cols / 2:
                    self.matrices.append((offset, rows, cols))
                    offset += numel
                    continue
            self.dense.append((offset, numel))
            offset += numel
        self.numel = offset
        self.q: list[torch.Tensor] | None = None

    def _initial_q(self, dtype: torch.dtype) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed)
        return [
            torch.randn(cols, self.rank, generator=generator).to(dtype)
            for _, _, cols in self.matrices
        ]

    def exchange(self, corrected: torch.Tensor) -> Exchange:
        n, d = corrected.shape
        if d != self.numel:
            raise ValueError(f"powersgd was planned for {self.numel} elements, got {d}")
        if self.q is None:
            self.q = self._initial_q(corrected.dtype)
        estimate = torch.zeros(d, dtype=corrected.dtype)
        for offset, numel in self.dense:
            estimate[offset : offset + numel] = corrected[:, offset : offset + numel].mean(dim=0)
        for j, (offset, rows, cols) in enumerate(self.matrices):
            m = corrected[:, offset : offset + rows * cols].reshape(n, rows, cols)
            p = (m @ self.q[j]).mean(dim=0)
            p = torch.linalg.qr(p, mode="reduced").Q
            q = (m.transpose(1, 2) @ p).mean(dim=0)
            self.q[j] = q
            estimate[offset : offset + rows * cols] = (p @ q.T).reshape(-1)
        size = corrected.element_size()
        dense = sum(numel for _, numel in self.dense)
        first = (dense + self.rank * sum(rows for _, rows, _ in self.matrices)) * size
        second = self.rank * sum(cols for _, _, cols in self.matrices) * size
        transfers = [Transfer("allreduce", first)]
        if self.matrices:
            transfers.append(Transfer("allreduce", second))
        # Parameters sent uncompressed leave nothing behind: each learner sent its own
        # values, so error feedback keeps no residual there (PyTorch's powerSGD_hook and
        # GRACE all-reduce them outside error feedback). Matrices sent P Q^T.
        sent = estimate.expand(n, d).clone()
        for offset, numel in self.dense:
            sent[:, offset : offset + numel] = corrected[:, offset : offset + numel]
        return Exchange(
            sent=sent,
            estimate=estimate,
            transfers=tuple(transfers),
            selected=[d] * n,
        )

    def settings(self) -> dict[str, float]:
        return {"rank": self.rank, "matrices": len(self.matrices)}
