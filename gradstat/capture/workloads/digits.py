"""A small CNN on the 8x8 handwritten digits that scikit-learn ships (1,797 images)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch import nn

from gradstat.capture.workloads import Batch, Workload


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


def digits_workload(scale: float) -> Workload:
    """Model width scales with ``scale`` (16 channels at 1.0, about 40k parameters)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    labels = torch.tensor(digits.target, dtype=torch.long)

    def batches(rank: int, world: int, batch_size: int, seed: int) -> Iterator[Batch]:
        order = np.random.default_rng(seed).permutation(len(labels))
        shard = torch.as_tensor(order[rank::world])  # each learner trains on its own shard
        generator = torch.Generator().manual_seed(seed * 1000 + rank)
        while True:
            pick = shard[torch.randint(len(shard), (batch_size,), generator=generator)]
            yield images[pick], labels[pick]

    return Workload(
        name="digits",
        description="CNN on scikit-learn's 8x8 handwritten digits",
        model=_digits_cnn(max(2, round(16 * scale))),
        batches=batches,
        loss=nn.functional.cross_entropy,
    )
