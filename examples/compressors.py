"""Two compressors of your own, in GRACE's shape, for gradstat (docs/compressors.md).

Use them wherever gradstat names a compressor:

    gradstat replay CAPTURE --compressors examples/compressors.py:TopK,topk --ratios 0.01
    gradstat replay CAPTURE --compressors examples/compressors.py:Quantize:bits=4
    gradstat recommend CAPTURE --error-budget 0.5 \\
        --compressors examples/compressors.py:TopK,examples/compressors.py:Quantize
    gradstat capture --workload digits --compressor examples/compressors.py:TopK --ratio 0.01
    gradstat compare DENSE_RUN TOPK_RUN

Nothing here imports gradstat: a class needs ``compress(tensor, name) -> (tensors, ctx)``
and ``decompress(tensors, ctx) -> tensor``; gradstat adds error feedback (a residual
memory), sends ``tensors`` (bytes on the wire = their sizes) and aggregates.
"""

from __future__ import annotations

import torch


class TopK:
    """Top-k sparsifier: the k largest magnitudes, as int64 indices and float32 values."""

    def __init__(self, compress_ratio: float) -> None:
        self.compress_ratio = compress_ratio  # gradstat passes each --ratios value here

    def compress(self, tensor: torch.Tensor, name: str):
        flat = tensor.flatten()
        k = max(1, int(flat.numel() * self.compress_ratio))  # GRACE's k
        _, indices = torch.topk(flat.abs(), k, sorted=False)
        return [indices, flat[indices]], (flat.numel(), tensor.shape)

    def decompress(self, tensors, ctx):
        indices, values = tensors
        numel, shape = ctx
        dense = torch.zeros(numel, dtype=values.dtype, device=values.device)
        dense.scatter_(0, indices, values)
        return dense.view(shape)


class NoFeedback:
    """A memory in GRACE's shape (``compensate`` / ``update``) that keeps nothing."""

    def compensate(self, tensor, name):
        return tensor

    def update(self, tensor, name, compressor, tensors, ctx):
        pass


class Quantize:
    """Stochastic uniform quantizer: ``bits`` per value (in int8) and one float32 scale.

    Unbiased (stochastic rounding), so it needs no error feedback: its ``memory`` keeps
    nothing (without one, gradstat's residual error feedback runs).
    """

    sparse = False  # a dense payload: every element is sent (no build-up to count)

    def __init__(self, bits: int = 8) -> None:
        if not 2 <= bits <= 8:
            raise ValueError(f"bits must be in 2..8, got {bits}")
        self.levels = 2 ** (bits - 1) - 1

    memory = NoFeedback  # a class: gradstat makes one per learner

    def compress(self, tensor: torch.Tensor, name: str):
        flat = tensor.flatten()
        scale = flat.abs().max().clamp_min(1e-30) / self.levels
        scaled = flat / scale
        low = scaled.floor()
        # torch's global generator: gradstat seeds it per step and learner from --seed
        codes = low + (torch.rand_like(scaled) < scaled - low).to(scaled.dtype)
        return [codes.to(torch.int8), scale.reshape(1)], tensor.shape

    def decompress(self, tensors, ctx):
        codes, scale = tensors
        return (codes.to(torch.float32) * scale).view(ctx)
