"""Random sparse payloads of a given model layout, for tests of the exchange and its codecs."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from demonet.optim import Compressed, Payload


def random_payload(specs: Mapping[str, tuple[tuple[int, ...], tuple[int, int]]], seed: int, k: int) -> Payload:
    """`k` distinct random indices per chunk of each tensor of `specs` (1-d or 2-d shapes that the chunks
    divide), with normal float32 values; the same payload for the same seed."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (shape, chunk) in specs.items():
        rows = (shape[0] // chunk[0]) * (shape[-1] // chunk[1]) if len(shape) == 2 else shape[0] // chunk[1]
        idx = torch.stack([torch.randperm(chunk[0] * chunk[1], generator=g)[:k] for _ in range(rows)])
        tensors[name] = Compressed(idx=idx, val=torch.randn(rows, k, generator=g), shape=shape, chunk=chunk)
    return Payload(tensors=tensors)
