"""A small decoder-only transformer (nanoGPT style) for demos, tests and benchmarks.

Imports torch and its config (`demonet.config.ModelConfig`) only: no optimizer, wire or network code.

Shape legend: B = batch, T = time (tokens), C = d_model, H = heads, D = head size, V = vocab.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from demonet.config import ModelConfig

__all__ = ["BENCH_MODEL", "GPT", "TINY_MODEL", "ModelConfig", "portable_normal_"]


BENCH_MODEL = ModelConfig(vocab_size=256, seq_len=256, d_model=384, n_layers=6, n_heads=6)
"""About 10.8M parameters: the benchmark model."""

TINY_MODEL = ModelConfig()
"""About 0.8M parameters: fast enough for CPU unit tests."""


class _SelfAttention(nn.Module):
    """Causal multi-head self-attention."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        B, T, C = x_BTC.shape
        H = self.n_heads
        q_BTC, k_BTC, v_BTC = self.qkv(x_BTC).split(C, dim=2)
        q_BHTD = q_BTC.view(B, T, H, C // H).transpose(1, 2)  # (B, H, T, D)
        k_BHTD = k_BTC.view(B, T, H, C // H).transpose(1, 2)  # (B, H, T, D)
        v_BHTD = v_BTC.view(B, T, H, C // H).transpose(1, 2)  # (B, H, T, D)
        y_BHTD = F.scaled_dot_product_attention(q_BHTD, k_BHTD, v_BHTD, is_causal=True)
        y_BTC = y_BHTD.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        out_BTC: torch.Tensor = self.proj(y_BTC)
        return out_BTC


class _MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        out_BTC: torch.Tensor = self.proj(F.gelu(self.fc(x_BTC)))
        return out_BTC


class _Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(cfg.d_model)
        self.attn = _SelfAttention(cfg)
        self.ln_mlp = nn.LayerNorm(cfg.d_model)
        self.mlp = _MLP(cfg)

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        x_BTC = x_BTC + self.attn(self.ln_attn(x_BTC))
        out_BTC: torch.Tensor = x_BTC + self.mlp(self.ln_mlp(x_BTC))
        return out_BTC


_FIELD_BITS = 15
_FIELDS = 6  # uniform fields summed per value: two from each of three 30-bit draws
_CHUNK = 1 << 22  # values per batch of draws: bounds the scratch to 48 MiB


@torch.no_grad()
def portable_normal_(t: torch.Tensor, std: float) -> torch.Tensor:
    """Fill `t` with approximately normal values of mean 0 and standard deviation `std`, the same
    bits on every machine, from the default torch generator.

    ``nn.init.normal_`` draws through vector kernels (Box-Muller with a vectorised log and cos), whose
    last bits differ between CPU kernel levels, so two machines seeded alike would start from
    different weights. Here each value is the centred sum of six uniform 15-bit integers (Irwin-Hall:
    a bell within +-4.2 std, kurtosis 2.8 against the normal's 3), drawn with integer-only
    ``torch.randint`` and scaled by one float64 multiplication, then rounded once to `t`'s dtype.
    """
    n = (1 << _FIELD_BITS) - 1
    scale = std / math.sqrt(((n + 1) ** 2 - 1) / 12 * _FIELDS)  # the sum's standard deviation
    flat = t.view(-1)
    for start in range(0, flat.numel(), _CHUNK):
        count = min(_CHUNK, flat.numel() - start)
        draws = torch.randint(0, 1 << (2 * _FIELD_BITS), (_FIELDS // 2, count), dtype=torch.int32)
        total = (draws & n).sum(dim=0, dtype=torch.int32) + (draws >> _FIELD_BITS).sum(dim=0, dtype=torch.int32)
        flat[start:start + count] = ((total - _FIELDS * n // 2).to(torch.float64) * scale).to(t.dtype)
    return t


class GPT(nn.Module):
    """Decoder-only transformer language model.

    Initialisation is deterministic given the global torch seed: every Linear and Embedding
    weight is normal(0, 0.02), biases are 0, and the projections that write into the residual
    stream use std 0.02 / sqrt(2 * n_layers) (GPT-2) so the stream's variance does not grow
    with depth.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        """Builds the model.

        Args:
            cfg: the model's shape.
        """
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.tok_emb.weight
        self._init_weights()

    def _init_weights(self) -> None:
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                # A tied head redraws the embedding with the same std: same distribution.
                portable_normal_(module.weight, std=resid_std if name.endswith(".proj") else 0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                portable_normal_(module.weight, std=0.02)

    def forward(
        self, idx_BT: torch.Tensor, targets_BT: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Runs the model.

        Args:
            idx_BT: (B, T) int64 token ids, T <= cfg.seq_len.
            targets_BT: (B, T) int64 next-token ids, or None.

        Returns:
            (B, T, V) logits, and the mean cross-entropy over all B*T positions (None without
            targets).
        """
        B, T = idx_BT.shape
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length should be <= seq_len={self.cfg.seq_len}, got {T}")
        pos_T = torch.arange(T, device=idx_BT.device)
        x_BTC = self.tok_emb(idx_BT) + self.pos_emb(pos_T)
        for block in self.blocks:
            x_BTC = block(x_BTC)
        logits_BTV: torch.Tensor = self.head(self.ln_f(x_BTC))
        if targets_BT is None:
            return logits_BTV, None
        V = logits_BTV.size(-1)
        loss = F.cross_entropy(logits_BTV.view(B * T, V), targets_BT.reshape(B * T))  # (B*T, V)
        return logits_BTV, loss

    def num_params(self) -> int:
        """Number of distinct parameters (a tied embedding counts once)."""
        return sum(p.numel() for p in self.parameters())
