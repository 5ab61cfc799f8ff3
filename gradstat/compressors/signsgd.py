"""signSGD with majority vote (Bernstein et al. 2018) and EF-signSGD (Karimireddy et al.
2019, docs/methods.md 4): one bit per element packed into uint8 plus one float32 scale
``||p||_1 / d``; all-gathered. signSGD aggregates by majority vote scaled by the
learners' mean scale (so its error is comparable) and keeps no memory; EF-signSGD
averages and keeps the residual in error-feedback memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gradstat.compressors.base import Compressor, pack_bits, unpack_bits
from gradstat.compressors.exchange import Tensors
from gradstat.compressors.memory import Memory, NoMemory, ResidualMemory
from gradstat.compressors.work import Ops, Work, pack_bits_ops, passes, unpack_bits_ops


class EFSignSGD(Compressor):
    """Sign bits plus the scale ``||p||_1 / d``, averaged, with error feedback."""

    name = "ef-signsgd"
    collective = "allgather"
    sparse = False
    majority = False

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Tensors, Any]:
        flat = tensor.reshape(-1)
        scale = flat.abs().mean().reshape(1)
        bits = pack_bits((flat >= 0).to(torch.int32), 1)
        return (bits, scale), flat.numel()

    def decompress(self, tensors: Tensors, ctx: Any) -> torch.Tensor:
        bits, scale = tensors
        signs = unpack_bits(bits, 1, ctx).to(scale.dtype) * 2 - 1
        return signs * scale

    def memory(self) -> Memory:
        return ResidualMemory()

    def work(self, numel: int, memory: Memory) -> Work:
        # scale: |p| mean (3); p >= 0 (1 comparison) packed; decode: unpack, 2 s - 1 (4),
        # times the scale (2); signSGD's majority vote: sign (2) and sum (1) per payload
        d = numel
        encode = memory.work(d) + passes(3, d, 2) + Ops(compare=d) + pack_bits_ops(d)
        decode = unpack_bits_ops(d) + passes(6 + (3 if self.majority else 0), d, 3)
        return Work(encode, Ops(), decode, "all")


class SignSGD(EFSignSGD):
    """signSGD: the majority vote of the signs, scaled by the learners' mean scale."""

    name = "signsgd"
    average = False
    majority = True

    def aggregate(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """``sign(sum of signs)`` times the learners' mean scale."""
        sent = torch.stack(list(tensors))
        scale = sent.abs().mean(dim=1).mean()
        return torch.sign(torch.sign(sent).sum(dim=0)) * scale

    def memory(self) -> Memory:
        return NoMemory()


def build(ctx: Any) -> Compressor:
    return SignSGD() if ctx.name == "signsgd" else EFSignSGD()
