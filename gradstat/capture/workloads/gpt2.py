"""A GPT-2-shaped causal decoder over bytes of real text.

At ``large`` it has GPT-2 small's shape (Radford et al. 2019): 12 pre-norm blocks of
width 768 with 12 heads, a 4x MLP with tanh-GELU, learned positions, a final LayerNorm
and the output layer tied to the token embedding; initialised as GPT-2 (normal, std
0.02; residual projections scaled by 1/sqrt(2 * layers)). With 256 byte tokens and a
context of 128 that is 85,350,912 parameters (GPT-2's 124M is mostly its 50,257-token
embedding and 1,024 positions). Module names follow Hugging Face's ``GPT2Model``
(``wte``, ``wpe``, ``h.N.attn.c_attn``, ...) so layer tables read alike; the linear
weights are ``nn.Linear``'s (out, in), the transpose of GPT-2's ``Conv1D``.

gradstat's own module rather than ``transformers``' ``GPT2LMHeadModel``: the capture
core then needs nothing beyond torch, and the model is 60 readable lines.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from gradstat.capture.workloads import Workload
from gradstat.capture.workloads.text import (
    byte_tokens,
    corpus_name,
    next_token_loss,
    window_batches,
)

VOCAB = 256  # bytes
CONTEXT = 128
# size -> (blocks, width, heads)
SHAPES = {"tiny": (2, 64, 4), "small": (4, 256, 4), "medium": (6, 512, 8), "large": (12, 768, 12)}


class SelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (
            t.view(batch, length, self.heads, width // self.heads).transpose(1, 2)
            for t in self.c_attn(x).split(width, dim=2)
        )
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(batch, length, width))


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(width, 4 * width)
        self.c_proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(nn.functional.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = SelfAttention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """Token + position embeddings, pre-norm blocks, final norm, tied output layer."""

    def __init__(self, blocks: int, width: int, heads: int, vocab: int, context: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(blocks))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2
        for name, parameter in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(parameter, std=0.02 / math.sqrt(2 * blocks))
            elif name.endswith("weight") and parameter.dim() == 2:
                nn.init.normal_(parameter, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(parameter)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def model(size: str) -> nn.Module:
    blocks, width, heads = SHAPES[size]
    return GPT2(blocks, width, heads, VOCAB, CONTEXT)


def build(size: str, data: Path | None) -> Workload:
    blocks, width, heads = SHAPES[size]
    return Workload(
        name="gpt2",
        size=size,
        description=f"GPT-2-shaped decoder ({blocks} blocks, width {width}, {heads} heads, "
        f"context {CONTEXT}) on the bytes of {corpus_name(data)}",
        model=model(size),
        batches=window_batches(byte_tokens(data), CONTEXT),
        loss=next_token_loss,
    )
