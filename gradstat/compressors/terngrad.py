"""TernGrad (Wen et al. 2017): ``s = max |p|``, each element ``s * sign * b`` with
``b ~ Bernoulli(|p| / s)`` (unbiased); 2-bit codes packed four per byte plus one float32
``s``; all-gathered; no error feedback. (The paper's optional gradient clipping is not
applied.) Each learner draws its own random stream, seeded from (``--seed``, step, learner,
message)."""

from __future__ import annotations

from typing import Any

import torch

from gradstat.compressors.base import Compressor, pack_bits, unpack_bits
from gradstat.compressors.exchange import Tensors
from gradstat.compressors.memory import Memory
from gradstat.compressors.work import Ops, Work, pack_bits_ops, passes, unpack_bits_ops


class TernGrad(Compressor):
    """TernGrad: ``s * sign(p) * Bernoulli(|p| / s)`` with ``s = max |p|``, 2 bits each."""

    name = "terngrad"
    collective = "allgather"
    sparse = False
    draws = True

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Tensors, Any]:
        tensor = tensor.reshape(-1)
        scale = tensor.abs().max().reshape(1)
        prob = tensor.abs() / scale.clamp_min(torch.finfo(tensor.dtype).tiny)
        keep = torch.rand(tensor.shape, generator=self.generator, dtype=tensor.dtype) < prob
        codes = (torch.sign(tensor) * keep).to(torch.int32) + 1
        return (pack_bits(codes, 2), scale), tensor.numel()

    def decompress(self, tensors: Tensors, ctx: Any) -> torch.Tensor:
        packed, scale = tensors
        codes = unpack_bits(packed, 2, ctx)
        return (codes - 1).to(scale.dtype) * scale

    def work(self, numel: int, memory: Memory) -> Work:
        # |p| max (3), |p| / s (4), noise < prob (1 read + comparison), sign (2), x (3),
        # to int32 + 1 (4), packed; decode: unpack, -1 (2), to float (2), x s (2)
        d = numel
        encode = memory.work(d) + passes(17, d, 10) + Ops(random=d, compare=d)
        encode += pack_bits_ops(d)
        return Work(encode, Ops(), unpack_bits_ops(d) + passes(6, d, 3), "all")


def build(ctx: Any) -> Compressor:
    return TernGrad()
