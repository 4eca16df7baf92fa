"""The tiny run the benchmarks of the coordinator's own costs train: a 1-layer, 32-wide GPT whose rounds
take milliseconds, so what is measured is the coordinator and the network, not the model."""

from __future__ import annotations

__all__ = ["TINY_MODEL"]

TINY_MODEL = """[model]
d_model = 32
n_layers = 1
n_heads = 2
seq_len = 32
[train]
seq_len = 32
batch_size = 2
"""
"""The [model] and [train] tables of a TOML run config; a caller appends its own [net] table."""
