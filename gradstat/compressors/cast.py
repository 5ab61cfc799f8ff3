"""16-bit casts (``fp16``, ``bf16``): the values cast before a dense all-reduce (2 bytes
each); no error feedback."""

from __future__ import annotations

from typing import Any

import torch

from gradstat.compressors.base import Compressor
from gradstat.compressors.exchange import Tensors
from gradstat.compressors.memory import Memory, NoMemory
from gradstat.compressors.work import Ops, Work, passes


class Cast(Compressor):
    """A cast to a 16-bit float type before a dense all-reduce."""

    collective = "allreduce"
    sparse = False

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Tensors, Any]:
        return (tensor.reshape(-1).to(self.dtype),), None

    def decompress(self, tensors: Tensors, ctx: Any) -> torch.Tensor:
        return tensors[0].float()

    def memory(self) -> Memory:
        return NoMemory()

    def work(self, numel: int, memory: Memory) -> Work:
        encode = memory.work(numel) + passes(1.5, numel)
        return Work(encode, Ops(), passes(1.5, numel), "one")


def build_fp16(ctx: Any) -> Compressor:
    return Cast(torch.float16)


def build_bf16(ctx: Any) -> Compressor:
    return Cast(torch.bfloat16)
