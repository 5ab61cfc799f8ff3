"""Text for the language-model workloads: the standard library's sources or ``--data``.

The default corpus is the Python standard library's own source code, present on every
machine that runs gradstat; ``--data FILE`` trains on any text file instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from gradstat.capture.workloads import Batch
from gradstat.errors import UsageError

CORPUS_BYTES = 2_000_000
DATA_LIMIT = 100_000_000  # bytes read from --data


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


def read_text(data: Path | None) -> bytes:
    """The stdlib corpus, or the first 100 MB of ``data``."""
    if data is None:
        return stdlib_corpus()
    try:
        return Path(data).read_bytes()[:DATA_LIMIT]
    except OSError as exc:
        raise UsageError(f"--data {data}: cannot read ({exc.strerror})") from None


def corpus_name(data: Path | None) -> str:
    return "the Python stdlib's sources" if data is None else str(data)


def window_batches(tokens: torch.Tensor, context: int) -> Callable[..., Iterator[Batch]]:
    """Batches of ``context``-token windows and their next tokens, per learner.

    Each learner draws windows at random from its own contiguous shard of ``tokens``.
    """
    if len(tokens) < 4 * (context + 1):
        raise UsageError(f"the text is too short: need at least {4 * (context + 1)} tokens")

    def batches(rank: int, world: int, batch_size: int, seed: int) -> Iterator[Batch]:
        shard_len = len(tokens) // world
        shard = tokens[rank * shard_len : (rank + 1) * shard_len]
        if len(shard) <= context + 1:
            raise UsageError("the text is too short for this many learners")
        generator = torch.Generator().manual_seed(seed * 1000 + rank)
        offsets = torch.arange(context + 1)
        while True:
            starts = torch.randint(len(shard) - context - 1, (batch_size, 1), generator=generator)
            window = shard[starts + offsets]
            yield window[:, :-1], window[:, 1:]

    return batches


def byte_tokens(data: Path | None) -> torch.Tensor:
    """The text's bytes as token ids 0..255."""
    return torch.frombuffer(bytearray(read_text(data)), dtype=torch.uint8).long()


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    )
