"""The apply path's cross-machine check: fixed parameters, fixed aggregates, the digests after applying.

`DeMo.apply` promises the same bits on every IEEE-754 machine. Everything here is built from Python
integers (Python's own `random`, powers of two), so the inputs are the same bits everywhere too; the
digests after applying must then be the same under any CPU kernel level, thread count or device.

Run as a script, it prints one JSON object {base: digest} (`--device cuda` to apply on a GPU):
``ATEN_CPU_CAPABILITY=default python tests/apply_check.py --threads 1``.
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from demonet.optim import BASES, Compressed, DeMo, Payload
from demonet.optim.payload import num_chunks
from demonet.wire.digest import param_digest

SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "big": ((512, 256), torch.float32),  # large enough for vector kernels and several threads
    "ragged": ((100, 72), torch.float32),  # a padded chunk grid
    "conv": ((8, 4, 3, 3), torch.float32),
    "bias": ((192,), torch.float32),
    "half": ((64, 64), torch.bfloat16),
    "scalar": ((), torch.float32),
}
ROUNDS = 4


def _exact_floats(rng: random.Random, n: int, spread: int) -> list[float]:
    """n floats m * 2^-e with |m| < 2^20: exact in float32, the same on every machine."""
    return [rng.randint(-(2**20), 2**20) * 2.0 ** -(20 + rng.randint(0, spread)) for _ in range(n)]


def make_params(device: str = "cpu") -> dict[str, torch.Tensor]:
    rng = random.Random(1234)
    params = {}
    for name, (shape, dtype) in SHAPES.items():
        numel = 1
        for d in shape:
            numel *= d
        t = torch.tensor(_exact_floats(rng, numel, 4), dtype=torch.float32).view(shape)
        params[name] = torch.nn.Parameter(t.to(dtype=dtype, device=device))
    return params


def make_optimizer(params: dict[str, torch.Tensor], base: str) -> DeMo:
    return DeMo(list(params.items()), lr=0.01, compression_topk=8, compression_chunk=32, weight_decay=0.1,
                base=base, chunk_policy="pad")


def make_aggregates(opt: DeMo, device: str = "cpu") -> list[Payload]:
    """ROUNDS aggregates for `opt`'s parameters: indices unique per row, values of widely spread
    magnitudes, a zero padding entry per row, widths that vary between rounds; in one round, a third
    of the rows hold pairs of values that cancel exactly or to 2^-20, so that decoded values are 0
    or within any float32 GEMM's rounding of it (where `sign`'s fast path must ask the exact sum)."""
    rng = random.Random(99)
    aggregates = []
    for r in range(ROUNDS):
        tensors = {}
        for name, (shape, chunk) in opt.param_specs().items():
            rows = num_chunks(shape, chunk)
            n = chunk[0] * chunk[1]
            width = min(n, (6, 13, 33, 3)[r])
            idx = [rng.sample(range(n), width) for _ in range(rows)]
            val = [_exact_floats(rng, width, 30) for _ in range(rows)]
            for row, (row_i, row_v) in enumerate(zip(idx, val, strict=True)):
                if width > 1:
                    row_i[-1], row_v[-1] = row_i[0], 0.0  # padding repeats a real index with value 0
                if r == 1 and row % 3 == 0:  # values that cancel: decoded values exactly 0 or next to it
                    for s in range(0, width - 2, 2):
                        row_i[s + 1] = row_i[s]
                        row_v[s + 1] = -row_v[s] * (1.0 if row % 2 else 1.0 - 2.0**-20)
            tensors[name] = Compressed(idx=torch.tensor(idx, dtype=torch.int64, device=device),
                                       val=torch.tensor(val, dtype=torch.float32, device=device),
                                       shape=shape, chunk=chunk)
        aggregates.append(Payload(tensors=tensors))
    return aggregates


def apply_digests(device: str = "cpu", trace: list[str] | None = None) -> dict[str, str]:
    """{base: digest of the parameters and the base optimizer's state after ROUNDS applies}.

    `trace`: a list that gets one line per base, round and tensor ("base round name digest"), to find
    where two settings part."""
    out = {}
    for base in BASES:
        params = make_params(device)
        opt = make_optimizer(params, base)

        def state() -> list[tuple[str, torch.Tensor]]:
            return [(f"{name}.{key}", opt.state[p][key]) for name, p in params.items()  # noqa: B023
                    for key in ("exp_avg", "exp_avg_sq") if key in opt.state[p]]  # noqa: B023

        for r, agg in enumerate(make_aggregates(opt, device)):
            opt.apply(agg)
            if trace is not None:
                named = [*params.items(), *state()]
                trace += [f"{base} {r} {name} {param_digest([(name, t)])[:12]}" for name, t in named]
        out[base] = param_digest([*params.items(), *state()])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--matmul-precision", default="highest", choices=("highest", "high", "medium"),
                        help="torch.set_float32_matmul_precision: below highest, the sign base takes its exact path")
    parser.add_argument("--trace", action="store_true", help="first a line per base, round and tensor with its digest")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_float32_matmul_precision(args.matmul_precision)
    trace: list[str] | None = [] if args.trace else None
    digests = apply_digests(args.device, trace)
    for line in trace or []:
        print(line)
    print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
                      "digests": digests}))


if __name__ == "__main__":
    main()
