"""A small causal transformer language model over bytes of real text."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from gradstat.capture.workloads import SIZES, Workload
from gradstat.capture.workloads.text import (
    byte_tokens,
    corpus_name,
    next_token_loss,
    window_batches,
)

CONTEXT = 64
VOCAB = 256  # bytes


class CharTransformer(nn.Module):
    """Byte embedding + learned positions + pre-norm causal transformer encoder."""

    def __init__(self, width: int, depth: int, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.position = nn.Parameter(torch.zeros(CONTEXT, width))
        layer = nn.TransformerEncoderLayer(
            width, heads, dim_feedforward=4 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(CONTEXT))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        hidden = self.embed(tokens) + self.position[:n]
        hidden = self.blocks(hidden, mask=self.mask[:n, :n], is_causal=True)
        return self.head(self.norm(hidden))


def model(size: str) -> nn.Module:
    """Width 64 and 2 blocks at ``small`` (about 137k parameters)."""
    scale = SIZES[size]
    return CharTransformer(width=max(16, round(64 * scale / 4) * 4), depth=2 if scale <= 1 else 4)


def build(size: str, data: Path | None) -> Workload:
    tokens = byte_tokens(data)
    return Workload(
        name="charlm",
        size=size,
        description=f"byte-level transformer LM on {corpus_name(data)}",
        model=model(size),
        batches=window_batches(tokens, CONTEXT),
        loss=next_token_loss,
    )
