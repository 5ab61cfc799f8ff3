"""Error-feedback memories, kept apart from compressors (GRACE's Compressor / Memory split).

A :class:`Memory` serves every learner of one scheme: it keeps one row per learner (two
for DGC) in row stores its driver hands it (:meth:`Memory.allocate`: the replay's RAM or
scratch-file rows, :mod:`gradstat.analysis.ef_store`; one row in RAM in the DDP hook),
hands the compressor learner i's corrected vector (:meth:`Memory.compensate`) and after
the exchange keeps what was not sent (:meth:`Memory.update`).

* Residual error feedback (Stich et al. 2018; Karimireddy et al. 2019, docs/methods.md 4):
  ``p = g + m``; ``c = C(p)``; ``m = p - c``. ScaleCom's low-pass variant (Chen et al.
  2021, arXiv 2104.11125) keeps ``m = (1 - beta) m + beta (p - c)``; beta = 1 is plain EF.
* DGC momentum correction with factor masking (Lin et al. 2018, arXiv 1712.01887):
  ``u = mu u + g``; ``v = v + u``; the compressor sees ``v``; ``u`` and ``v`` are zeroed
  where something was sent.
* No memory: the compressor sees ``g`` (unbiased quantisers, casts). A user's class
  that brings a GRACE memory applies it itself (:mod:`gradstat.compressors.user`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from gradstat.compressors.work import Ops, passes
from gradstat.stats.row_kernels import momentum_add, squared_norm


class RowStore(Protocol):
    """``learners x numel`` float32 rows: ``load(i)`` (a view or a copy), ``save(i, row)``."""

    def load(self, row: int) -> torch.Tensor: ...

    def save(self, row: int, values: torch.Tensor) -> None: ...


#: ``new_rows(learners, numel)``: a zeroed row store.
NewRows = Callable[[int, int], RowStore]


class TensorRows:
    """Rows in one tensor, zero at first (the DDP hook's one row)."""

    def __init__(self, rows: int, numel: int) -> None:
        self.data = torch.zeros(rows, numel)

    def load(self, row: int) -> torch.Tensor:
        return self.data[row]

    def save(self, row: int, values: torch.Tensor) -> None:
        if values.data_ptr() != self.data[row].data_ptr():
            self.data[row].copy_(values)


def row_norm(row: torch.Tensor) -> float:
    """||row||_2 summed in float64 in one pass (:func:`~gradstat.stats.row_kernels.
    squared_norm` on the CPU; a whole-row ``double()`` cost 18 ms of an 8M-value step's 75)."""
    flat = row.reshape(-1)
    if flat.device.type == "cpu" and flat.dtype == torch.float32:
        return math.sqrt(squared_norm(np.ascontiguousarray(flat.numpy())))
    return float(torch.linalg.vector_norm(flat, dtype=torch.float64))


def squares_left(squares: float, before: torch.Tensor, after: torch.Tensor | None = None) -> float:
    """||m||^2 of a memory ``m`` that is the row ``p`` but at some indices, from ``squares``
    = ||p||^2 found while forming ``p``: ``before`` and ``after`` are the values there
    (``after`` None: zeroed). In float64, to its rounding of ||p||^2 (a few 1e-16 of it,
    kept from going below 0); it saves a pass over the new memory."""
    squares -= float(before.double().square().sum())
    if after is not None:
        squares += float(after.double().square().sum())
    return max(squares, 0.0)


class Memory:
    """The error-feedback memory of one scheme's learners (see the module docstring).

    ``rows``: rows per learner it keeps (what the replay budgets); ``momentum``: DGC's
    factor (the replay then judges the estimate against the dense momentum update);
    ``plain_residual``: ``m = p - sent`` exactly, so a stream may form ``p`` in the memory
    row and leave the residual there (:meth:`ResidualMemory.keep`); ``masks_sent``: DGC's
    factor masking (:meth:`DGCMemory.mask_sent`).
    """

    rows: int = 0
    momentum: float = 0.0
    plain_residual: bool = False
    masks_sent: bool = False

    def allocate(self, learners: int, numel: int, new_rows: NewRows) -> None:
        """Make the rows of ``learners`` learners of ``numel`` values (zero)."""
        self.learners, self.numel = learners, numel
        self.norms: list[float] = []

    def peek(self, i: int, g: torch.Tensor) -> torch.Tensor:
        """Learner i's corrected vector without changing anything (CLT-k's leader)."""
        return g

    def compensate(self, i: int, g: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Learner i's corrected vector ``p`` and the state :meth:`update` needs."""
        return g, ()

    def update(self, i: int, p: torch.Tensor, sent: torch.Tensor, state: Any) -> None:
        """Keep what learner i did not send of ``p`` (``sent`` dense)."""
        self.norms.append(0.0)

    def norm(self) -> float:
        """Mean over learners of ``||memory_i||`` after this step (then starts afresh)."""
        norms, self.norms = self.norms, []
        return sum(norms) / len(norms) if norms else 0.0

    def work(self, numel: int) -> Ops:
        """Compensate and update, for the cost model (:mod:`gradstat.compressors.work`)."""
        return Ops()


class NoMemory(Memory):
    """No error feedback: ``p = g``, nothing is kept."""


class ResidualMemory(Memory):
    """Per-learner residual memory ``m`` with optional low-pass factor ``beta``."""

    rows = 1

    def __init__(self, beta: float = 1.0) -> None:
        if not 0.0 < beta <= 1.0:
            raise ValueError(f"beta must be in (0, 1], got {beta}")
        self.beta = beta
        self.plain_residual = beta == 1.0

    def allocate(self, learners: int, numel: int, new_rows: NewRows) -> None:
        super().allocate(learners, numel, new_rows)
        self.m = new_rows(learners, numel)

    def peek(self, i: int, g: torch.Tensor) -> torch.Tensor:
        return g + self.m.load(i)

    def compensate(self, i: int, g: torch.Tensor) -> tuple[torch.Tensor, Any]:
        m = self.m.load(i)
        return g + m, m

    def update(self, i: int, p: torch.Tensor, sent: torch.Tensor, state: Any) -> None:
        """``m = (1 - beta) m + beta (p - c)``."""
        m = state
        if self.beta == 1.0:
            torch.sub(p, sent, out=m)
        else:
            m.mul_(1.0 - self.beta).add_(p - sent, alpha=self.beta)
        self.m.save(i, m)
        self.norms.append(row_norm(m))

    def keep(self, i: int, m: torch.Tensor, squares: float | None = None) -> None:
        """Store a residual row formed in place (``plain_residual``); ``squares``: its
        ||m||^2 when the caller found it on the way (else a pass over ``m``)."""
        self.m.save(i, m)
        self.norms.append(row_norm(m) if squares is None else math.sqrt(squares))

    def park(self, i: int, p: torch.Tensor) -> None:
        """Keep the corrected row in the memory row until a later pass (plain EF only)."""
        self.m.save(i, p)

    def work(self, numel: int) -> Ops:
        extra = 0 if self.beta == 1.0 else 3
        return passes(3 + 3 + extra, numel, 2 + (extra > 0))


class DGCMemory(Memory):
    """DGC's momentum correction ``u`` and accumulation ``v`` with factor masking.

    The compressor selects from ``v``; after the exchange ``u`` and ``v`` are zeroed at
    the coordinates that were sent (``sent != 0``), so momentum of sent coordinates does
    not keep pushing stale values (Lin et al. 2018, section 3.2).
    """

    rows = 2
    masks_sent = True

    def __init__(self, momentum: float = 0.9) -> None:
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.momentum = momentum

    def allocate(self, learners: int, numel: int, new_rows: NewRows) -> None:
        super().allocate(learners, numel, new_rows)
        self.u, self.v = new_rows(learners, numel), new_rows(learners, numel)

    def peek(self, i: int, g: torch.Tensor) -> torch.Tensor:
        u = self.u.load(i) * self.momentum + g
        return self.v.load(i) + u

    def compensate(self, i: int, g: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """``u = mu u + g``; ``v = v + u``; returns ``v`` and ``(u, v, counted)``:
        ``counted`` is the new v's (zeros, float64 sum of squares) on the CPU, found in
        the same pass (:func:`~gradstat.stats.row_kernels.momentum_add`), else None."""
        u, v = self.u.load(i), self.v.load(i)
        counted = None
        if u.device.type == "cpu":  # one pass, the same bits
            counted = momentum_add(u.numpy(), v.numpy(), g.numpy(), self.momentum)
        else:
            u.mul_(self.momentum).add_(g)
            v.add_(u)
        return v, (u, v, counted)

    def update(self, i: int, p: torch.Tensor, sent: torch.Tensor, state: Any) -> None:
        """``v = v - c`` and zero ``u`` and ``v`` where ``c`` is non-zero."""
        u, v, _ = state
        mask = sent != 0
        torch.sub(p, sent, out=v)
        v.masked_fill_(mask, 0.0)
        u.masked_fill_(mask, 0.0)
        self.u.save(i, u)
        self.v.save(i, v)
        self.norms.append(row_norm(v))

    def mask_sent(self, i: int, sent: torch.Tensor, state: Any, values: torch.Tensor) -> None:
        """:meth:`update` for a sparse payload: ``u`` and ``v`` zeroed at ``sent``, the
        indices of the non-zero ``values`` sent. ``v`` is the corrected row itself, so
        ``v - sent`` differs from ``v`` only there, where factor masking zeroes it: the
        same numbers as :meth:`update` with the dense ``sent``. The new norm is ||v||^2
        less the squares sent, when :meth:`compensate` found ||v||^2."""
        u, v, counted = state
        v.index_fill_(0, sent, 0.0)
        u.index_fill_(0, sent, 0.0)
        self.u.save(i, u)
        self.v.save(i, v)
        if counted is None:
            self.norms.append(row_norm(v))
        else:
            self.norms.append(math.sqrt(squares_left(counted[1], values)))

    def work(self, numel: int) -> Ops:
        # u = mu u + g (3), v += u (3); v = p - c (3); mask c != 0; 2 masked fills
        return passes(3 + 3 + 3 + 2 * 2.25, numel, 6) + Ops(compare=numel)
