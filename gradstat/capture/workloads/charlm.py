"""A small causal transformer language model over bytes of real text.

The default corpus is the Python standard library's own source code, present on every
machine that runs gradstat; ``--data FILE`` trains on any text file instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from gradstat.capture.workloads import Batch, Workload
from gradstat.errors import UsageError

CONTEXT = 64
VOCAB = 256  # bytes
CORPUS_BYTES = 2_000_000


def stdlib_corpus(limit: int = CORPUS_BYTES) -> bytes:
    """The first ``limit`` bytes of the standard library's sources, in a fixed order."""
    root = Path(os.__file__).parent
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_bytes()
        chunks.append(text)
        total += len(text)
        if total >= limit:
            break
    return b"".join(chunks)[:limit]


def read_corpus(data: Path | None) -> torch.Tensor:
    if data is None:
        raw = stdlib_corpus()
    else:
        try:
            raw = Path(data).read_bytes()[: CORPUS_BYTES * 50]
        except OSError as exc:
            raise UsageError(f"--data {data}: cannot read ({exc.strerror})") from None
    if len(raw) < 4 * (CONTEXT + 1):
        raise UsageError(f"--data {data}: too short, need at least {4 * (CONTEXT + 1)} bytes")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


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


def _next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def charlm_workload(scale: float, data: Path | None) -> Workload:
    """Width 64 and 2 blocks at scale 1.0 (about 130k parameters)."""
    corpus = read_corpus(data)

    def batches(rank: int, world: int, batch_size: int, seed: int) -> Iterator[Batch]:
        shard_len = len(corpus) // world  # each learner reads its own contiguous shard
        shard = corpus[rank * shard_len : (rank + 1) * shard_len]
        if len(shard) <= CONTEXT + 1:
            raise UsageError("the text is too short for this many learners")
        generator = torch.Generator().manual_seed(seed * 1000 + rank)
        offsets = torch.arange(CONTEXT + 1)
        while True:
            starts = torch.randint(len(shard) - CONTEXT - 1, (batch_size, 1), generator=generator)
            window = shard[starts + offsets]
            yield window[:, :-1], window[:, 1:]

    return Workload(
        name="charlm",
        description="byte-level transformer LM on "
        + ("the Python stdlib's sources" if data is None else str(data)),
        model=CharTransformer(
            width=max(16, round(64 * scale / 4) * 4), depth=2 if scale <= 1 else 4
        ),
        batches=batches,
        loss=_next_token_loss,
    )
