"""A small CNN on the 8x8 handwritten digits that scikit-learn ships (1,797 images)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch import nn

from gradstat.capture.workloads import SIZES, Batch, Workload


def _digits_cnn(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * width * 16, 4 * width),
        nn.ReLU(),
        nn.Linear(4 * width, 10),
    )


def model(size: str) -> nn.Module:
    """16 channels at ``small`` (about 38k parameters)."""
    return _digits_cnn(max(2, round(16 * SIZES[size])))


def load_digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 1,797 digits as (N, 1, 8, 8) floats in [0, 1], and their labels."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    return images, torch.tensor(digits.target, dtype=torch.long)


def sharded_batches(
    images: torch.Tensor, labels: torch.Tensor
) -> Callable[[int, int, int, int], Iterator[Batch]]:
    """Batches drawn with replacement from each learner's own shard of a shuffled set."""

    def batches(rank: int, world: int, batch_size: int, seed: int) -> Iterator[Batch]:
        order = np.random.default_rng(seed).permutation(len(labels))
        shard = torch.as_tensor(order[rank::world])  # each learner trains on its own shard
        generator = torch.Generator().manual_seed(seed * 1000 + rank)
        while True:
            pick = shard[torch.randint(len(shard), (batch_size,), generator=generator)]
            yield images[pick], labels[pick]

    return batches


def build(size: str) -> Workload:
    images, labels = load_digits_tensors()
    return Workload(
        name="digits",
        size=size,
        description="CNN on scikit-learn's 8x8 handwritten digits",
        model=model(size),
        batches=sharded_batches(images, labels),
        loss=nn.functional.cross_entropy,
    )
