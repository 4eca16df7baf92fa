"""Benchmark: what the codec and the merge cost per tensor of a payload, against the same entries in fewer tensors.

It makes --peers real payloads of the model (one training step each, data seeds 0..N-1; the embedded
default unless --config) and the same payloads with every tensor of one chunk shape concatenated, row
after row, into one tensor (bf16 and fp32 values have no per-tensor scale, so the entries are the same),
and prints side by side, medians over --reps in milliseconds, one torch thread: `wire.encode` and
`wire.decode` of one payload, and the merge of the N payloads as the coordinator makes it
(`wire.merge.merge`: top-k, median-norm clipping, the aggregate's encode). A round's exchange runs
these on its critical path (docs/benchmarks.md#a-cpu-for-each-process-what-a-round-costs-with-nothing-shared),
so what a layout with fewer tensors would save there shows here. Not a test; the wire format is not
changed. Run from the repo root: `python bench/codec_tensors.py`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dht_exchange_cpu import _ms  # noqa: E402  (a sibling script's median timer, not a package)

from demonet import wire  # noqa: E402
from demonet.config import load_config  # noqa: E402
from demonet.optim import Compressed, Payload  # noqa: E402
from demonet.train.trainer import Trainer  # noqa: E402
from demonet.wire.merge import MergeRules, merge  # noqa: E402


def by_chunk(payload: Payload) -> Payload:
    """`payload` with the tensors of each chunk shape concatenated into one, in the order they come."""
    groups: dict[tuple[int, int], list[Compressed]] = {}
    for c in payload.tensors.values():
        if c.scale is not None:
            raise SystemExit(f"{payload.encoding} values carry a scale per tensor: use bf16 or fp32 values")
        groups.setdefault(c.chunk, []).append(c)
    tensors = {}
    for i, (chunk, cs) in enumerate(groups.items()):
        rows = sum(int(c.idx.shape[0]) for c in cs)
        tensors[f"chunk{i}"] = Compressed(idx=torch.cat([c.idx for c in cs]), val=torch.cat([c.val for c in cs]),
                                          shape=(rows * chunk[0], chunk[1]), chunk=chunk)
    return Payload(tensors=tensors, encoding=payload.encoding)


def _measure(layout: list[Payload], rules: MergeRules, reps: int) -> dict[str, Any]:
    """Times (ms) of encoding and decoding `layout[0]` and of merging every payload of `layout`; their bytes."""
    first = layout[0]
    data = wire.encode(first, step=1)
    expected = {name: (tuple(c.shape), c.chunk) for name, c in first.tensors.items()}
    decoded = [wire.decode(wire.encode(p, step=1), expected=expected)[1] for p in layout]
    return {"tensors": len(first.tensors), "bytes": len(data),
            "aggregate": len(merge(decoded, step=1, rules=rules, expected=expected).data),
            "encode": _ms(lambda: wire.encode(first, step=1), reps),
            "decode": _ms(lambda: wire.decode(data, expected=expected), reps),
            "merge": _ms(lambda: merge(decoded, step=1, rules=rules, expected=expected), max(reps // 4, 5))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="TOML run config (default: the embedded default model)")
    parser.add_argument("--peers", type=int, default=4, help="payloads merged (4)")
    parser.add_argument("--reps", type=int, default=100, help="timed repetitions (100)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(args.config)
    rules = MergeRules.from_config(cfg)
    payloads = [Trainer.for_run(cfg, data_seed=i, device=torch.device("cpu")).train_step()[1]
                for i in range(args.peers)]
    print(f"# the codec and the merge by layout: {args.config or 'the embedded default model'}, {args.peers} "
          f"payloads of {payloads[0].numel():,} entries ({payloads[0].encoding} values), torch {torch.__version__}")
    print()
    print("| layout | tensors | payload B | encode ms | decode ms | merge ms | aggregate B |")
    print("|---|---|---|---|---|---|---|")
    rows = {}
    for label, layout in (("a tensor per parameter (the wire today)", list(payloads)),
                          ("a tensor per chunk shape", [by_chunk(p) for p in payloads])):
        m = rows[label] = _measure(layout, rules, args.reps)
        print(f"| {label} | {m['tensors']} | {m['bytes']:,} | {m['encode']:.2f} | {m['decode']:.2f} "
              f"| {m['merge']:.2f} | {m['aggregate']:,} |")
    now, fewer = rows.values()
    print()
    print("fewer tensors / a tensor per parameter: "
          + ", ".join(f"{k} {fewer[k] / now[k]:.2f}x" for k in ("encode", "decode", "merge")))


if __name__ == "__main__":
    main()
