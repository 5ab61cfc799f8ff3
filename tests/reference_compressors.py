"""The plain whole-step reference of every built-in compressor, for the tests.

One step of all learners at once, on the stacked corrected vectors ``p[n, d]``, with
each error-feedback memory kept as a dense ``[n, d]`` tensor: the arithmetic of the
papers written out, with none of gradstat's streaming, in-place forms or fast paths.
Top-k sets come from ``torch.topk``; threshold estimates from
:func:`gradstat.stats.thresholds.estimate_threshold` (the statistic, tested on its own in
test_thresholds.py and test_reference_behaviours.py), what is sent from them plainly.
Random streams follow the protocol's rule: learner i's draws at recorded step t of
message j come from numpy's ``SeedSequence([seed, t, i + 1, j])``, a draw every learner
shares (random-k's indices) from ``SeedSequence([seed, t, 0, j])`` (the first 64-bit
word, halved), so a window of steps draws what a whole replay draws there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from gradstat.stats.sidco import AdaptiveStages
from gradstat.stats.thresholds import estimate_threshold

#: The number formats, compressors since issue 37 (gradstat/compressors/cast.py).
FORMAT_NAMES = ("fp16", "bf16", "fp8-e4m3", "fp8-e5m2", "mxfp8", "mxfp6", "mxfp4")
ESTIMATED = (
    "threshold",
    "dgc",
    "gaussiank",
    "redsync",
    "redsync-sidco",
    "sidco-exp",
    "sidco-gpd",
    "sidco-gamma-gpd",
)
ZEROS, STAGE_FITS = ("exclude", "include"), ("moments", "mle")
TINY = torch.finfo(torch.float32).tiny


@dataclass
class Outcome:
    """One step: each learner's dense ``sent``, the aggregate, bytes per learner per
    collective, elements sent, the union of sparse sets and per-payload numbers."""

    sent: torch.Tensor
    estimate: torch.Tensor
    transfers: list[tuple[str, float]]
    selected: list[int]
    union: int | None = None
    info: dict[str, float] = field(default_factory=dict)
    memory_norm: float = 0.0


def draws(seed: int, step: int, learner: int | None, message: int = 0) -> torch.Generator:
    """The generator of ``learner``'s draws (None: the draw all learners share)."""
    who = 0 if learner is None else learner + 1
    word = np.random.SeedSequence([seed, step, who, message]).generate_state(1, np.uint64)[0]
    return torch.Generator().manual_seed(int(word >> 1))


def top(row: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(row.abs(), k).indices


def keep(p: torch.Tensor, indices: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each learner's ``p`` at its own indices, zero elsewhere."""
    sent = torch.zeros_like(p)
    for i, idx in enumerate(indices):
        sent[i, idx] = p[i, idx]
    return sent


def union(indices: Sequence[torch.Tensor]) -> int:
    return int(torch.unique(torch.cat([i.long() for i in indices])).numel())


class Reference:
    """A whole-step replay of built-in ``name`` with ``params`` (registry defaults
    filled in) at ``ratio`` / ``k`` on ``n`` learners of ``d`` values."""

    def __init__(self, name, params, ratio, k, d, shapes, seed, n, message=0) -> None:
        self.name, self.params, self.ratio, self.k = name, dict(params), ratio, k
        self.d, self.shapes, self.seed, self.n = d, shapes, seed, n
        self.message = message
        self.t = 0
        self.memory = "none"
        if name in ("topk", "randomk", "gtopk", "powersgd", "ef-signsgd") or (
            name in ESTIMATED and name != "dgc"
        ):
            self.memory = "residual"
        if name == "clt-k":
            self.memory = "residual"
        if name == "dgc":
            self.memory = "dgc"
        self.beta = self.params.get("beta", 1.0)
        self.m = torch.zeros(n, d)
        self.u = torch.zeros(n, d)
        self.adaptive = [AdaptiveStages(initial=3) for _ in range(n)]
        self.threshold = self.params.get("threshold") or None
        self.q: list[torch.Tensor] | None = None
        self.velocity: torch.Tensor | None = None

    # --- memories ------------------------------------------------------------------
    def compensate(self, g: torch.Tensor) -> torch.Tensor:
        if self.memory == "residual":
            return g + self.m
        if self.memory == "dgc":
            self.u = self.params["momentum"] * self.u + g
            self.m = self.m + self.u
            return self.m.clone()
        return g

    def update(self, p: torch.Tensor, sent: torch.Tensor) -> float:
        if self.memory == "residual":
            self.m = (
                p - sent
                if self.beta == 1
                else self.m.mul_(1 - self.beta).add_(p - sent, alpha=self.beta)
            )
        elif self.memory == "dgc":
            mask = sent != 0
            self.m = (p - sent).masked_fill(mask, 0.0)
            self.u = self.u.masked_fill(mask, 0.0)
        else:
            return 0.0
        return float(torch.linalg.vector_norm(self.m.double(), dim=1).mean())

    def reference(self, mean_grad: torch.Tensor) -> torch.Tensor:
        """The dense update the estimate is judged against (DGC: momentum's)."""
        if self.memory != "dgc":
            return mean_grad
        mu = self.params["momentum"]
        self.velocity = mean_grad if self.velocity is None else mu * self.velocity + mean_grad
        return self.velocity

    def step(self, g: torch.Tensor, t: int | None = None) -> Outcome:
        """One step (recorded step ``t``: the draws' and CLT-k's leader's; default: the
        steps counted from 0)."""
        self.t = self.t if t is None else t
        self.generators = [draws(self.seed, self.t, i, self.message) for i in range(self.n)]
        self.shared = draws(self.seed, self.t, None, self.message)
        p = self.compensate(g)
        name = "estimated" if self.name in ESTIMATED else self.name.replace("-", "_")
        if self.name in FORMAT_NAMES:
            name = "format"
        out = getattr(self, f"_{name}")(p)
        out.memory_norm = self.update(p, out.sent)
        self.t += 1
        return out

    # --- compressors ---------------------------------------------------------------
    def _dense(self, sent, nbytes, collective="allreduce") -> Outcome:
        return Outcome(sent, sent.mean(0), [(collective, nbytes)], [self.d] * self.n)

    def _none(self, p):
        return self._dense(p, 4 * self.d)

    def _format(self, p) -> Outcome:
        """A number format's default collective, a ring with float32 sums
        (tests/test_collectives.py's sequential loop), all-gathered in the format; each
        learner sent its chunks rounded, its own chunk as it is."""
        from gradstat.wire.formats import FORMATS
        from tests.test_collectives import _send, ring_loop

        fmt, n, d = FORMATS[self.name], self.n, self.d
        total = torch.cat([_send(fmt, o) for o in ring_loop(list(p), fmt, False)])[:d]
        size = math.ceil(d / n)
        starts = range(0, d, size)
        sent = torch.stack(
            [
                torch.cat([row[s : s + size] if j == i else _send(fmt, row[s : s + size])
                           for j, s in enumerate(starts)])
                for i, row in enumerate(p)
            ]
        )  # fmt: skip
        nbytes = sum(fmt.wire_bytes(min(size, d - s)) for s in starts)
        return Outcome(sent, total / n, [("allreduce", nbytes)], [d] * n)

    def _sparse(self, p, indices) -> Outcome:
        sent = keep(p, indices)
        sizes = [i.numel() * 8 for i in indices]
        out = Outcome(sent, sent.mean(0), [("allgather", sum(sizes) / self.n)], [])
        out.selected = [int(i.numel()) for i in indices]
        out.union = union(indices)
        return out

    def _topk(self, p):
        return self._sparse(p, [top(row, self.k) for row in p])

    def _estimated(self, p):
        estimator = {"threshold": "hard"}.get(self.name, self.name)
        indices, infos = [], []
        for i, row in enumerate(p):
            if estimator == "hard":
                if self.threshold is None:
                    self.threshold = estimate_threshold(row, self.ratio, "topk").threshold
                result = estimate_threshold(row, self.ratio, "hard", threshold=self.threshold)
            else:
                result = estimate_threshold(
                    row,
                    self.ratio,
                    estimator,
                    stages=int(self.params.get("stages", 0)) or self.adaptive[i].stages,
                    generator=self.generators[i],
                    zeros=ZEROS[int(self.params.get("zeros", 0))],
                    stage_fit=STAGE_FITS[int(self.params.get("stage_fit", 0))],
                )
            above = (
                row.abs() >= result.threshold if result.inclusive else row.abs() > result.threshold
            )
            idx = torch.nonzero(above).view(-1)
            self.adaptive[i].update(idx.numel() / self.k)
            indices.append(idx)
            infos.append((float(result.threshold), float(result.stages)))
        out = self._sparse(p, indices)
        out.info = {
            "threshold": sum(t for t, _ in infos) / self.n,
            "stages": sum(s for _, s in infos) / self.n,
        }
        return out

    def _shared(self, p, idx) -> Outcome:
        sent = keep(p, [idx] * self.n)
        estimate = torch.zeros(self.d)
        estimate[idx] = p[:, idx].mean(0)
        return Outcome(sent, estimate, [("allreduce", 4 * self.k)], [self.k] * self.n, self.k)

    def _randomk(self, p):
        return self._shared(p, torch.randperm(self.d, generator=self.shared)[: self.k])

    def _clt_k(self, p):
        leader = self.t % self.n
        out = self._shared(p, top(p[leader], self.k))
        out.transfers.insert(0, ("broadcast", 4 * self.k))
        out.info = {"leader": leader}
        return out

    def _gtopk(self, p):
        """Local top-k, merged in pairs (top-k of each sum) over ceil(log2 n) rounds; a
        learner's pair counts as sent if it survives every merge on its path."""
        local = [top(row, self.k) for row in p]
        nodes = [({int(j): float(p[i, j]) for j in idx}, [i]) for i, idx in enumerate(local)]
        alive = [set(int(j) for j in idx) for idx in local]
        while len(nodes) > 1:
            merged = []
            for a in range(0, len(nodes) - 1, 2):
                (left, lm), (right, rm) = nodes[a], nodes[a + 1]
                summed = {j: left.get(j, 0.0) + right.get(j, 0.0) for j in left | right}
                best = sorted(summed, key=lambda j: -abs(summed[j]))[: self.k]
                node = {j: summed[j] for j in best}
                for i in lm + rm:
                    alive[i] &= set(node)
                merged.append((node, lm + rm))
            nodes = merged + ([nodes[-1]] if len(nodes) % 2 else [])
        indices = [torch.tensor(sorted(s), dtype=torch.long) for s in alive]
        sent = keep(p, indices)
        pair = 8 * self.k
        out = Outcome(sent, sent.mean(0), [("reduce", pair), ("broadcast", pair)], [])
        out.selected, out.union = [self.k] * self.n, len(nodes[0][0])
        return out

    def _powersgd(self, p):
        """Vogels et al. 2019, Algorithm 1, per matrix with (a + b) r < a b / 2, warm Q."""
        r = int(self.params["rank"])
        plan, offset = [], 0
        for shape in self.shapes:
            numel = math.prod(shape)
            a = shape[0]
            matrix = len(shape) >= 2 and (a + numel // a) * r < a * (numel // a) / 2
            plan.append((offset, numel, a if matrix else None))
            offset += numel
        matrices = [(o, a, n // a) for o, n, a in plan if a]
        if self.q is None:
            generator = torch.Generator().manual_seed(self.seed)
            self.q = [torch.randn(b, r, generator=generator) for _, _, b in matrices]
        estimate = p.mean(0)
        sent = estimate.expand(self.n, self.d).clone()
        for offset, numel, a in plan:
            if not a:
                sent[:, offset : offset + numel] = p[:, offset : offset + numel]
        for j, (o, a, b) in enumerate(matrices):
            m = p[:, o : o + a * b].reshape(self.n, a, b)
            pj = torch.linalg.qr((m @ self.q[j]).mean(0), mode="reduced").Q
            self.q[j] = (m.transpose(1, 2) @ pj).mean(0)
            estimate[o : o + a * b] = (pj @ self.q[j].T).reshape(-1)
            sent[:, o : o + a * b] = estimate[o : o + a * b]
        dense = sum(n for _, n, a in plan if not a)
        first = 4 * (dense + r * sum(a for _, a, _ in matrices))
        second = 4 * r * sum(b for _, _, b in matrices)
        transfers = [("allreduce", first)] + ([("allreduce", second)] if matrices else [])
        return Outcome(sent, estimate, transfers, [self.d] * self.n)

    def _signs(self, p):
        scales = p.abs().mean(1, keepdim=True)
        return torch.where(p >= 0, 1.0, -1.0) * scales, scales

    def _ef_signsgd(self, p):
        sent, _ = self._signs(p)
        return self._dense(sent, math.ceil(self.d / 8) + 4, "allgather")

    def _signsgd(self, p):
        sent, _ = self._signs(p)
        out = self._dense(sent, math.ceil(self.d / 8) + 4, "allgather")
        out.estimate = torch.sign(torch.sign(sent).sum(0)) * sent.abs().mean(1).mean()
        return out

    def _qsgd(self, p):
        s, bucket = int(self.params["levels"]), int(self.params["bucket"])
        pad = (-self.d) % bucket
        sent = torch.zeros_like(p)
        for i, row in enumerate(p):
            x = torch.nn.functional.pad(row, (0, pad)).view(-1, bucket)
            norm = torch.linalg.vector_norm(x, dim=1, keepdim=True)
            noise = torch.rand(x.shape, generator=self.generators[i])
            level = torch.floor(x.abs() / norm.clamp_min(TINY) * s + noise).clamp_max(s)
            sent[i] = (level * torch.sign(x) * norm / s).view(-1)[: self.d]
        level_bytes = 1 if s <= 127 else 2
        return self._dense(sent, self.d * level_bytes + 4 * math.ceil(self.d / bucket), "allgather")

    def _terngrad(self, p):
        sent = torch.zeros_like(p)
        for i, row in enumerate(p):
            scale = row.abs().max()
            keep_it = torch.rand(
                row.shape, generator=self.generators[i]
            ) < row.abs() / scale.clamp_min(TINY)
            sent[i] = torch.sign(row) * keep_it * scale
        return self._dense(sent, math.ceil(self.d / 4) + 4, "allgather")


def ef_topk(grads: np.ndarray, ratio: float, feedback: bool = True) -> list[dict]:
    """Top-k with residual error feedback (none unless ``feedback``), step by step, in
    numpy, for a user's GRACE-style top-k: ``k = max(1, int(d * ratio))``; per step
    ``k``, the union (how many elements any learner sent), the relative error of the mean
    of what the learners sent against the mean gradient, and the mean norm of the
    learners' memories."""
    n, steps, d = grads.shape
    k = max(1, int(d * ratio))
    memory = np.zeros((n, d), dtype=np.float32)
    out = []
    for s in range(steps):
        p = grads[:, s] + memory
        sent = np.zeros_like(p)
        for i in range(n):
            chosen = np.argsort(-np.abs(p[i]), kind="stable")[:k]
            sent[i, chosen] = p[i, chosen]
        memory = p - sent if feedback else memory
        mean = grads[:, s].astype(np.float64).mean(axis=0)
        estimate = sent.astype(np.float64).mean(axis=0)
        out.append(
            {
                "step": s,
                "k": k,
                "union": int(np.count_nonzero(sent.any(axis=0))),
                "rel_error": float(((estimate - mean) ** 2).sum() / (mean**2).sum()),
                "memory_norm": float(np.linalg.norm(memory.astype(np.float64), axis=1).mean()),
            }
        )
    return out
