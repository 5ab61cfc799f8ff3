"""QSGD (Alistarh et al. 2017): per bucket of ``bucket`` elements one float32 norm and per
element a signed level in ``[-s, s]`` rounded stochastically (unbiased), sent as int8
(int16 when ``s > 127``, as GRACE does); all-gathered; no error feedback. Each learner
draws its own random stream, seeded from (``--seed``, step, learner, message)."""

from __future__ import annotations

from typing import Any

import torch

from gradstat.compressors.base import Compressor
from gradstat.compressors.exchange import Tensors
from gradstat.compressors.memory import Memory
from gradstat.compressors.work import Ops, Work, passes


class QSGD(Compressor):
    """QSGD with ``levels`` s and buckets of ``bucket`` elements (stochastic, unbiased)."""

    name = "qsgd"
    collective = "allgather"
    sparse = False
    draws = True

    def __init__(self, levels: int = 127, bucket: int = 512, seed: int = 0) -> None:
        if not 1 <= levels <= 32767:
            raise ValueError(f"qsgd levels must be in 1..32767, got {levels}")
        if bucket < 1:
            raise ValueError(f"qsgd bucket must be positive, got {bucket}")
        self.levels = levels
        self.bucket = bucket
        self.level_dtype = torch.int8 if levels <= 127 else torch.int16
        self.generator = torch.Generator().manual_seed(seed)

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Tensors, Any]:
        tensor = tensor.reshape(-1)
        d = tensor.numel()
        padded = torch.nn.functional.pad(tensor, (0, (-d) % self.bucket)).view(-1, self.bucket)
        norms = torch.linalg.vector_norm(padded, dim=1, keepdim=True)
        scaled = padded.abs() / norms.clamp_min(torch.finfo(tensor.dtype).tiny) * self.levels
        noise = torch.rand(scaled.shape, generator=self.generator, dtype=tensor.dtype)
        level = torch.floor(scaled + noise).clamp_max(self.levels) * torch.sign(padded)
        return (level.view(-1)[:d].to(self.level_dtype), norms.view(-1)), d

    def decompress(self, tensors: Tensors, ctx: Any) -> torch.Tensor:
        level, norms = tensors
        d = ctx
        padded = torch.nn.functional.pad(level.to(norms.dtype), (0, (-d) % self.bucket))
        values = padded.view(-1, self.bucket) * norms.unsqueeze(1) / self.levels
        return values.view(-1)[:d]

    def settings(self) -> dict[str, float]:
        return {"levels": self.levels, "bucket": self.bucket}

    def work(self, numel: int, memory: Memory) -> Work:
        # pad (2), bucket norms (1), |p| (2), / norm (3), x s (2), noise, + (3), floor (2),
        # clamp (2), sign (2), x (3), to int8 (1.25); decode: to float, pad, x norm, / s
        encode = memory.work(numel) + passes(23.25, numel, 12) + Ops(random=numel)
        return Work(encode, Ops(), passes(10.25, numel, 4), "all")


def build(ctx: Any) -> Compressor:
    levels, bucket = int(ctx.params["levels"]), int(ctx.params["bucket"])
    return QSGD(levels, bucket)
