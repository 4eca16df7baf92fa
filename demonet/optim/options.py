"""DeMo's arguments and their validation: the reference's signature, and `DeMoOptions` beyond it.

Math layer: imports its sibling modules only (no protobuf, grpc, hivemind, asyncio or torch.distributed).
The run config (`demonet.config.OptimConfig`) calls `check_lr`, so the optimizer and a run share one rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .chunking import CHUNK_POLICIES
from .payload import ENCODINGS

__all__ = ["BASES", "DeMoOptions", "check_args", "check_lr"]

BASES = ("sign", "sgd", "adamw")
"""The base optimizer phi applied to the decoded aggregate u (DeMo v2): ``sign`` is Signum, as the
reference (``p -= lr * sign(u)``); ``sgd`` is the identity (``p -= lr * u``); ``adamw`` runs Adam's
moments on u (FlexDeMo's DeToAdamW) with decoupled weight decay."""


@dataclass(frozen=True)
class DeMoOptions:
    """DeMo's settings beyond the reference's signature, validated once, when made.

    Attributes:
        base: the base optimizer, one of `BASES`.
        alpha: momentum subtraction coefficient in (0, 1] (DeMo v2); 1.0 is the reference.
        encoding: value encoding of the payload, one of `demonet.optim.ENCODINGS`.
        chunk_policy: ``reference`` (divisors, the default for parity) or ``pad`` (see
            `demonet.optim.chunking`).
        betas, eps: Adam's coefficients for ``base="adamw"``.
        bucket_cap_mb: blocks are transformed in buckets of at most this size (a larger tensor gets
            a bucket of its own); scratch memory is two buckets. None: by the parameters' device
            (`demonet.optim.buckets.default_bucket_cap_mb`): 4 MiB on a CPU keeps a bucket's passes in
            its last-level cache; 128 MiB on an accelerator keeps the kernels a step launches a fixed
            number, not one set per 4 MiB of parameters.
        chunks: an explicit (h, w) chunk per parameter name, instead of `chunk_policy` on its shape.
            A sharded parameter (a DTensor, e.g. under FSDP2's ``fully_shard``) is optimized on its
            local shard (``to_local()``); giving it the whole parameter's chunk keeps the shard's
            blocks exactly the whole parameter's blocks when the shard is a whole number of chunks.
    """

    base: str = "sign"
    alpha: float = 1.0
    encoding: str = "fp32"
    chunk_policy: str = "reference"
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    bucket_cap_mb: float | None = None
    chunks: Mapping[str, tuple[int, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        checks = [
            (self.base in BASES, f"base should be one of {BASES}, got {self.base!r}"),
            (0.0 < self.alpha <= 1.0, f"alpha should be in (0, 1], got {self.alpha}"),
            (self.encoding in ENCODINGS, f"encoding should be one of {ENCODINGS}, got {self.encoding!r}"),
            (self.chunk_policy in CHUNK_POLICIES,
             f"chunk_policy should be one of {CHUNK_POLICIES}, got {self.chunk_policy!r}"),
            (len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas),
             f"betas should be in [0, 1), got {self.betas}"),
            (self.eps > 0.0, f"eps should be > 0, got {self.eps}"),
            (self.bucket_cap_mb is None or self.bucket_cap_mb > 0.0,
             f"bucket_cap_mb should be > 0 or None, got {self.bucket_cap_mb}"),
        ]
        _raise_first(checks)
        for name, hw in self.chunks.items():
            if len(hw) != 2 or not all(isinstance(x, int) and x > 0 for x in hw):
                raise ValueError(f"chunks[{name!r}] should be two positive ints (h, w), got {hw!r}")


def check_lr(lr: float) -> None:
    """The learning rate DeMo and a run's config accept: > 0 (NaN is refused too).

    A param group may still set ``lr`` to 0 to freeze itself, as in torch's optimizers (group
    values are not checked); the default every group starts from must be able to learn.

    Raises:
        ValueError: ``lr should be > 0, got ...``.
    """
    if not lr > 0.0:
        raise ValueError(f"lr should be > 0, got {lr}")


def check_args(lr: float, compression_decay: float, compression_topk: int, compression_chunk: int,
               weight_decay: float) -> None:
    """The reference's arguments (bloc97/DeMo's signature).

    Raises:
        ValueError: the first argument out of range, named in the message.
    """
    check_lr(lr)
    _raise_first([
        (0.0 <= compression_decay < 1.0, f"compression_decay should be in [0, 1), got {compression_decay}"),
        (isinstance(compression_topk, int) and compression_topk > 0,
         f"compression_topk should be a positive int, got {compression_topk}"),
        (isinstance(compression_chunk, int) and compression_chunk > 0,
         f"compression_chunk should be a positive int, got {compression_chunk}"),
        (weight_decay >= 0.0, f"weight_decay should be >= 0, got {weight_decay}"),
    ])


def _raise_first(checks: list[tuple[bool, str]]) -> None:
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
