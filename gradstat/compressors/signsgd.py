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
from gradstat.compressors.exchange import Stream, Tensors
from gradstat.compressors.memory import Memory, NoMemory
from gradstat.compressors.streams import LocalStream
from gradstat.compressors.work import Ops, Work, pack_bits_ops, passes, stack_ops, unpack_bits_ops


class EFSignSGD(Compressor):
    """Sign bits plus the scale ``||p||_1 / d``, averaged, with error feedback."""

    name = "ef-signsgd"
    collective = "allgather"
    sparse = False
    majority = False

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Tensors, Any]:
        scale = tensor.abs().mean().reshape(1)
        bits = pack_bits((tensor >= 0).to(torch.int32), 1)
        return (bits, scale), tensor.numel()

    def decompress(self, tensors: Tensors, ctx: Any) -> torch.Tensor:
        bits, scale = tensors
        signs = unpack_bits(bits, 1, ctx).to(scale.dtype) * 2 - 1
        return signs * scale

    def work(self, numel: int, memory: Memory) -> Work:
        # scale: |p| mean (3); p >= 0 (1 comparison) packed; decode: unpack, 2 s - 1 (4),
        # times the scale (2); signSGD's majority vote: sign (2) and sum (1) per payload
        d = numel
        encode = memory.work(d) + passes(3, d, 2) + Ops(compare=d) + pack_bits_ops(d)
        decode = unpack_bits_ops(d) + passes(6 + (3 if self.majority else 0), d, 3)
        return Work(encode, Ops(), decode, stack_ops(d), "all")


class SignSGD(EFSignSGD):
    """signSGD: the majority vote of the signs, scaled by the learners' mean scale."""

    name = "signsgd"
    average = False
    majority = True

    def aggregate(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        sent = torch.stack(list(tensors))
        scale = sent.abs().mean(dim=1).mean()
        return torch.sign(torch.sign(sent).sum(dim=0)) * scale

    def memory(self) -> Memory:
        return NoMemory()

    def stream(self, scheme: Any, name: str, learners: int, numel: int) -> Stream:
        return MajorityStream(scheme, name, learners, numel)


class MajorityStream(LocalStream):
    """signSGD's vote one row at a time: the sum of the signs and each learner's scale."""

    def start_aggregate(self) -> None:
        if self.total is None:
            self.total = torch.zeros(self.d)
        else:
            self.total.zero_()
        self.scales: list[torch.Tensor] = []

    def fold(self, sent: torch.Tensor) -> None:
        self.total += torch.sign(sent)
        self.scales.append(sent.abs().mean())

    def estimate(self) -> torch.Tensor:
        return torch.sign(self.total) * torch.stack(self.scales).mean()


def build_majority(ctx: Any) -> Compressor:
    return SignSGD()


def build_ef(ctx: Any) -> Compressor:
    return EFSignSGD()
