"""A task that is not a transformer: a small convolutional network that learns to tell generated shapes apart.

Train it with any demonet command, from the folder that holds `examples/`:

    demonet train --task examples.custom_task:task --peers 2 --steps 100 --lr 0.03
    demonet up --task examples.custom_task:task --peers 4 --steps 200 --lr 0.03 --out runs/cnn

It wants a learning rate of 0.03: the default 3e-3 suits the built-in GPT, and moves this network's loss
little from ln 4 in 200 rounds.

With a run config, its `[task]` table is the function's keyword arguments (`size = 16`, `classes = 4`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

import demonet


def _shapes(gen: torch.Generator, batch: int, size: int, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch` noisy images: class c is a bright square whose corner sits in band c of the image."""
    labels = torch.randint(0, classes, (batch,), generator=gen)
    images = 0.3 * torch.randn(batch, 1, size, size, generator=gen)
    band = size // classes
    side = max(2, band // 2)
    for i, c in enumerate(labels.tolist()):
        top = c * band + int(torch.randint(0, max(1, band - side + 1), (1,), generator=gen))
        left = int(torch.randint(0, size - side + 1, (1,), generator=gen))
        images[i, 0, top:top + side, left:left + side] += 1.0
    return images, labels


def task(size: int = 16, classes: int = 4, batch_size: int = 32) -> demonet.Task:
    """A `demonet.Task`: the network, each peer's endless stream of generated batches, cross-entropy."""
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(16, classes))

    def batches(seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        gen = torch.Generator().manual_seed(seed)
        while True:
            yield _shapes(gen, batch_size, size, classes)

    def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        images, labels = batch
        return nn.functional.cross_entropy(model(images), labels)

    return demonet.Task(model=model, batches=batches, loss=loss)
