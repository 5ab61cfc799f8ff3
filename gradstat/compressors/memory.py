"""Error-feedback memories, kept apart from compressors (GRACE's Compressor / Memory split).

A :class:`Memory` serves every learner and message of one scheme, its rows per block of
the plan in row stores its driver hands it (:meth:`Memory.allocate`; the replay's RAM or
scratch-file rows, the DDP hook's tensors). A driver opens a learner's rows of a block
(:meth:`Memory.open`), forms each message's corrected vector (:meth:`Memory.compensate`),
after the exchange keeps what was not sent (:meth:`Memory.update`) and closes them.

* Residual error feedback (Stich et al. 2018; Karimireddy et al. 2019, docs/methods.md 4):
  ``p = g + m``; ``c = C(p)``; ``m = p - c``. ScaleCom's low-pass variant (Chen et al.
  2021, arXiv 2104.11125) keeps ``m = (1 - beta) m + beta (p - c)``; beta = 1 is plain EF,
  whose ``p`` is formed in the memory row itself.
* DGC momentum correction with factor masking (Lin et al. 2018, arXiv 1712.01887):
  ``u = mu u + g``; ``v = v + u``; the compressor sees ``v``; ``u`` and ``v`` are zeroed
  where something non-zero was sent.
* No memory: the compressor sees (a copy of) ``g``.
* A user's memory in GRACE's shape (:class:`UserMemory`, docs/compressors.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any, Protocol

import numpy as np
import torch

from gradstat.compressors.exchange import Call, Sent, SparseRow
from gradstat.compressors.work import Ops, passes
from gradstat.stats.row_kernels import momentum_add, squared_norm


class RowStore(Protocol):
    """``learners x numel`` float32 rows: ``load(i)`` (a view or a copy), ``save(i, row)``."""

    def load(self, row: int) -> torch.Tensor: ...

    def save(self, row: int, values: torch.Tensor) -> None: ...


#: ``new_rows(learners, numel)``: a zeroed row store.
NewRows = Callable[[int, int], RowStore]


class TensorRows:
    """Rows in one tensor, zero at first (the DDP hook's, tests')."""

    def __init__(self, rows: int, numel: int) -> None:
        self.data = torch.zeros(rows, numel)

    def load(self, row: int) -> torch.Tensor:
        return self.data[row]

    def save(self, row: int, values: torch.Tensor) -> None:
        if values.data_ptr() != self.data[row].data_ptr():
            self.data[row].copy_(values)


def row_norm(row: torch.Tensor) -> float:
    """||row||_2 summed in float64 in one pass (compiled on the CPU)."""
    flat = row.reshape(-1)
    if flat.device.type == "cpu" and flat.dtype == torch.float32:
        return math.sqrt(squared_norm(np.ascontiguousarray(flat.numpy())))
    return float(torch.linalg.vector_norm(flat, dtype=torch.float64))


def _cpu32(*rows: torch.Tensor) -> bool:
    return all(r.device.type == "cpu" and r.dtype == torch.float32 for r in rows)


#: A message's gradient as the driver hands it: one flat tensor, or its pieces in order
#: (a DDP bucket's parameters, which lie in reverse order in the row), not copied.
Pieces = torch.Tensor | Sequence[torch.Tensor]


def joined(g: Pieces) -> torch.Tensor:
    """``g`` as one flat tensor (its pieces copied end to end; a tensor as it is)."""
    return g if isinstance(g, torch.Tensor) else torch.cat(list(g))


def _spans(g: Pieces) -> list[tuple[int, torch.Tensor]]:
    """``(start, piece)`` of each piece of ``g`` in the message."""
    spans, start = [], 0
    for piece in [g] if isinstance(g, torch.Tensor) else g:
        spans.append((start, piece))
        start += piece.numel()
    return spans


class Memory:
    """The error-feedback memory of one scheme (see the module docstring).

    ``rows``: rows per learner it keeps (what the replay budgets); ``momentum``: DGC's
    factor (the replay then judges the estimate against the dense momentum update);
    ``label``: its name in the records."""

    rows: int = 0
    momentum: float = 0.0
    label: str = "none"

    def allocate(self, learners: int, plan: Any, new_rows: NewRows) -> None:
        """Lay the plan's compressed messages out in one row per block (each message's
        ``(block, start, stop)`` in :attr:`places`) for ``learners`` learners."""
        self.places: dict[int, tuple[int, int, int]] = {}
        self.widths: list[int] = []
        for b, block in enumerate(plan.blocks):
            width = 0
            for m in block.messages:
                if not plan.messages[m].dense:
                    numel = plan.messages[m].numel
                    self.places[m] = (b, width, width + numel)
                    width += numel
            self.widths.append(width)
        self.make_rows(learners, new_rows)

    def make_rows(self, learners: int, new_rows: NewRows) -> None:
        """Make the row stores: one per kind of row (:attr:`rows` kinds) and block."""
        self.stores = [[new_rows(learners, w) for w in self.widths] for _ in range(self.rows)]

    def open(self, learner: int, block: int) -> Any:
        """Learner ``learner``'s rows of ``block``, one per kind (views, or copies to
        :meth:`close`)."""
        return tuple(kind[block].load(learner) for kind in self.stores)

    def close(self, learner: int, block: int, rows: Any) -> None:
        """Keep the rows :meth:`open` handed out."""
        for kind, row in zip(self.stores, rows, strict=True):
            kind[block].save(learner, row)

    def part(self, rows: torch.Tensor, message: int) -> torch.Tensor:
        _, start, stop = self.places[message]
        return rows[start:stop]

    def compensate(self, rows: Any, call: Call, g: Pieces) -> torch.Tensor:
        """The corrected vector ``p`` of message ``call.index`` (flat; its own storage,
        valid until :meth:`update`) from ``g`` (flat or in pieces, valid for this call
        only); facts found on the way go to ``call.facts``."""
        return g.clone() if isinstance(g, torch.Tensor) else joined(g)

    def update(self, rows: Any, call: Call, p: torch.Tensor, sent: Sent, compressor: Any) -> float:
        """Keep what was not sent of ``p``; the new memory's squared norm (NaN unknown)."""
        return 0.0

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
        self.label = "residual" if beta == 1.0 else f"residual:beta={beta:g}"

    def compensate(self, rows: Any, call: Call, g: Pieces) -> torch.Tensor:
        """``p = m + g``; with beta = 1 formed in the memory row itself, piece by piece."""
        m = self.part(rows[0], call.index)
        if self.beta != 1.0:
            return m + joined(g)
        for start, piece in _spans(g):
            m[start : start + piece.numel()].add_(piece)
        return m

    def update(self, rows: Any, call: Call, p: torch.Tensor, sent: Sent, compressor: Any) -> float:
        """``m = (1 - beta) m + beta (p - c)``; a sparse ``c`` is subtracted at its indices."""
        m = self.part(rows[0], call.index)
        c = sent.contribution()
        if self.beta != 1.0:
            c = c.dense() if isinstance(c, SparseRow) else c.reshape(-1)
            m.mul_(1.0 - self.beta).add_(p - c, alpha=self.beta)
        elif isinstance(c, SparseRow):  # p is m: p - c differs from p only at c's indices
            m.index_add_(0, c.indices.long(), c.values, alpha=-1)
        else:
            torch.sub(p, c.reshape(-1), out=m)
        return row_norm(m) ** 2

    def work(self, numel: int) -> Ops:
        extra = 0 if self.beta == 1.0 else 3
        return passes(3 + 3 + extra, numel, 2 + (extra > 0))


class DGCMemory(Memory):
    """DGC's momentum correction ``u`` and accumulation ``v`` with factor masking.

    The compressor selects from ``v``; after the exchange ``u`` and ``v`` are zeroed at
    the coordinates where something non-zero was sent, so momentum of sent coordinates
    does not keep pushing stale values (Lin et al. 2018, section 3.2).
    """

    rows = 2

    def __init__(self, momentum: float = 0.9) -> None:
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.momentum = momentum
        self.label = "dgc" if momentum == 0.9 else f"dgc:momentum={momentum:g}"

    def compensate(self, rows: Any, call: Call, g: Pieces) -> torch.Tensor:
        """``u = mu u + g``; ``v = v + u``; returns ``v`` (its non-zeros in
        ``call.facts`` on the CPU)."""
        u, v = (self.part(r, call.index) for r in rows)
        nonzeros = 0
        for start, piece in _spans(g):
            u_at, v_at = u[start : start + piece.numel()], v[start : start + piece.numel()]
            if _cpu32(u, v, piece):  # one pass, the same bits as the three below
                zeros, _ = momentum_add(u_at.numpy(), v_at.numpy(), piece.numpy(), self.momentum)
                nonzeros += piece.numel() - zeros
            else:
                u_at.mul_(self.momentum).add_(piece)
                v_at.add_(u_at)
        if _cpu32(u, v):
            call.facts["nonzeros"] = nonzeros
        return v

    def update(self, rows: Any, call: Call, p: torch.Tensor, sent: Sent, compressor: Any) -> float:
        """``v = v - c``, then ``u`` and ``v`` zeroed where ``c`` is non-zero (``v`` is
        ``p`` itself: ``v - c`` differs from ``v`` only where ``c`` is sent)."""
        u, v = (self.part(r, call.index) for r in rows)
        c = sent.contribution()
        if isinstance(c, SparseRow):
            where = c.indices.long()[c.values != 0]
            v.index_fill_(0, where, 0.0)
            u.index_fill_(0, where, 0.0)
        else:
            mask = c.reshape(-1) != 0
            torch.sub(p, c.reshape(-1), out=v)
            v.masked_fill_(mask, 0.0)
            u.masked_fill_(mask, 0.0)
        return row_norm(v) ** 2

    def work(self, numel: int) -> Ops:
        # u = mu u + g (3), v += u (3); v = p - c (3); mask c != 0; 2 masked fills
        return passes(3 + 3 + 3 + 2 * 2.25, numel, 6) + Ops(compare=numel)


class UserMemory(Memory):
    """A user's memory in GRACE's shape, one object per learner made by ``make()``
    (its class or function); ``blame`` names failures in the user's code
    (:class:`~gradstat.compressors.user.Blame`). Its rows are the object's own (budgeted
    as one row per learner); its norm is unknown to gradstat (NaN)."""

    rows = 1

    def __init__(self, make: Callable[[], Any], blame: Any, label: str) -> None:
        self.make, self.blame, self.label = make, blame, label

    def make_rows(self, learners: int, new_rows: NewRows) -> None:
        self.objects = [self._made() for _ in range(learners)]

    def _made(self) -> Any:
        made = self.blame.call("memory", self.make)
        for method in ("compensate", "update"):
            if not callable(getattr(made, method, None)):
                raise self.blame.wrong("memory", self.make, f"made no {method} method")
        return made

    def open(self, learner: int, block: int) -> Any:
        return self.objects[learner]

    def close(self, learner: int, block: int, rows: Any) -> None:
        """The object keeps its own state."""

    def compensate(self, rows: Any, call: Call, g: Pieces) -> torch.Tensor:
        g = super().compensate(rows, call, g)
        p = self.blame.call("memory.compensate", rows.compensate, g.view(call.shape), call.name)
        if not isinstance(p, torch.Tensor) or p.numel() != g.numel():
            raise self.blame.wrong("memory.compensate", rows.compensate, "returned no vector")
        return p.reshape(-1)

    def update(self, rows: Any, call: Call, p: torch.Tensor, sent: Sent, compressor: Any) -> float:
        shape = call.shape
        seen = getattr(compressor, "grace", None)  # a user's own object, else a built-in's
        if seen is None:  # decoding in the shape the compressor was handed, as GRACE's
            decode = compressor.decompress
            seen = SimpleNamespace(decompress=lambda t, c: decode(t, c).reshape(shape))
        payload = list(sent.payload)
        update = rows.update
        self.blame.call("memory.update", update, p.view(shape), call.name, seen, payload, sent.ctx)
        return math.nan

    def work(self, numel: int) -> Ops:
        return passes(6, numel, 2)
