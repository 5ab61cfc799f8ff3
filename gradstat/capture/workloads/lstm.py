"""A 2-layer LSTM word-level language model, the PTB setup of Zaremba et al. (2014).

Sizes follow Zaremba et al.'s small, medium and large models (hidden 200, 650, 1,500;
embedding = hidden; 2 layers; 10,000-word vocabulary; 35-token sequences), the large
one being the 66M-parameter LSTM that SIDCo and GRACE measured on PTB:
embedding 10,000 x 1,500 + two LSTM layers (4 x 1,500 x 3,000 weights + 2 x 4 x 1,500
biases each) + decoder 1,500 x 10,000 + 10,000 = 66,034,000 parameters. ``tiny`` (hidden
32, 1,000 words) is for tests. No dropout, so gradients depend only on the data.

Words: the text is split into identifiers/numbers (``\\w+``) and single punctuation
characters; the vocabulary is the most frequent ``vocab - 1`` of them (ties broken by
first appearance) plus ``<unk>`` for all others. With fewer distinct words than that, the
vocabulary (and the parameter count) is smaller.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from gradstat.capture.workloads import Workload
from gradstat.capture.workloads.text import corpus_name, next_token_loss, read_text, window_batches

SEQUENCE = 35
# size -> (hidden = embedding width, vocabulary)
SHAPES = {
    "tiny": (32, 1_000),
    "small": (200, 10_000),
    "medium": (650, 10_000),
    "large": (1_500, 10_000),
}
WORD = re.compile(rb"\w+|[^\w\s]")


def word_tokens(text: bytes, vocab: int) -> tuple[torch.Tensor, int]:
    """Token ids of the text's words and the vocabulary size (id 0 is ``<unk>``)."""
    words = WORD.findall(text)
    ranked = [word for word, _ in Counter(words).most_common(vocab - 1)]  # stable for ties
    ids = {word: index for index, word in enumerate(ranked, start=1)}
    return torch.tensor([ids.get(word, 0) for word in words], dtype=torch.long), len(ids) + 1


class LSTMLanguageModel(nn.Module):
    """Embedding, stacked LSTM, linear decoder (names as PyTorch's word_language_model)."""

    def __init__(self, vocab: int, hidden: int, layers: int = 2) -> None:
        super().__init__()
        self.encoder = nn.Embedding(vocab, hidden)
        self.rnn = nn.LSTM(hidden, hidden, layers, batch_first=True)
        self.decoder = nn.Linear(hidden, vocab)
        for weight in (self.encoder.weight, self.decoder.weight):  # as word_language_model
            nn.init.uniform_(weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(self.encoder(tokens))
        return self.decoder(hidden)


def model(size: str, vocab: int | None = None) -> nn.Module:
    hidden, nominal_vocab = SHAPES[size]
    return LSTMLanguageModel(vocab or nominal_vocab, hidden)


def build(size: str, data: Path | None) -> Workload:
    hidden, nominal_vocab = SHAPES[size]
    tokens, vocab = word_tokens(read_text(data), nominal_vocab)
    return Workload(
        name="lstm",
        size=size,
        description=f"2-layer LSTM LM (hidden {hidden}, {vocab:,} words) on {corpus_name(data)}",
        model=model(size, vocab),
        batches=window_batches(tokens, SEQUENCE),
        loss=next_token_loss,
    )
