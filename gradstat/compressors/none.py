"""No compression: the dense float32 all-reduce every compressor is judged against."""

from __future__ import annotations

from typing import Any

import torch

from gradstat.compressors.base import Compressor
from gradstat.compressors.exchange import Tensors
from gradstat.compressors.memory import Memory
from gradstat.compressors.work import Ops, Work


class NoCompression(Compressor):
    """Every float32 value, summed by a ring all-reduce."""

    name = "none"
    collective = "allreduce"
    sparse = False

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Tensors, Any]:
        return (tensor.reshape(-1),), None

    def decompress(self, tensors: Tensors, ctx: Any) -> torch.Tensor:
        return tensors[0]

    def work(self, numel: int, memory: Memory) -> Work:
        return Work(Ops(), Ops(), Ops(), "one")


def build(ctx: Any) -> Compressor:
    return NoCompression()
