"""Benchmark: when an overlapped round's payload is encoded for the wire, on a GPU.

An overlapped peer submits round r's payload, then queues round r+1's forward and backward at once.
The exchange encodes the payload on another thread. Two ways are timed, round-robin:

- `direct`: the exchange encodes the device payload (its copies to the host go on the device's default
  stream, behind the next round's kernels);
- `staged`: `demonet.optim.to_host` copies it to pinned host memory on a side stream as it is made, and
  the exchange waits only for that copy.

Prints, per way, the median milliseconds from the submit until the payload's bytes are ready, next to a
forward and backward alone: a way that waits for the next round's compute takes about as long as it.
Needs a CUDA device.
Run from the repo root: `python bench/host_stage.py`. Prints a table; not a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from demonet import wire  # noqa: E402
from demonet.optim import DeMo, to_host  # noqa: E402
from demonet.train.data import Batches, load_corpus  # noqa: E402
from demonet.train.model import BENCH_MODEL, GPT  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=15, help="timed submits per way (median reported; 15)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per batch (16)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/host_stage.py needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = GPT(BENCH_MODEL).to(device)
    opt = DeMo(list(model.parameters()), lr=1e-3, compression_topk=32, compression_chunk=64)
    batches = Batches(load_corpus(), batch_size=args.batch, seq_len=BENCH_MODEL.seq_len, seed=0)
    x_BT, y_BT = (t.to(device) for t in next(batches))

    def forward_backward() -> None:
        _, loss = model(x_BT, y_BT)
        assert loss is not None
        loss.backward()

    def submit(staged: bool) -> float:
        """Compress, hand the payload to an exchange thread, queue the next forward and backward; ms until
        the exchange has the payload's bytes."""
        forward_backward()
        torch.cuda.synchronize()
        payload = opt.compress()
        opt.zero_grad(set_to_none=True)
        start = time.perf_counter()
        sent, ready = to_host(payload) if staged else (payload, None)
        done: list[float] = []

        def exchange() -> None:
            if ready is not None:
                ready.synchronize()
            wire.encode(sent, step=0)
            done.append(time.perf_counter())

        thread = threading.Thread(target=exchange)
        thread.start()
        forward_backward()  # round r+1, queued at once, as the overlapped loop does
        thread.join()
        torch.cuda.synchronize()
        opt.restore(payload)
        model.zero_grad(set_to_none=True)
        return (done[0] - start) * 1e3

    def compute() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        forward_backward()
        torch.cuda.synchronize()
        model.zero_grad(set_to_none=True)
        return (time.perf_counter() - start) * 1e3

    times: dict[str, list[float]] = {"forward+backward alone": [], "direct": [], "staged": []}
    for i in range(args.reps + 2):
        got = {"forward+backward alone": compute(), "direct": submit(False), "staged": submit(True)}
        if i >= 2:
            for name, ms in got.items():
                times[name].append(ms)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, {model.num_params() / 1e6:.1f}M "
          f"parameters, batch {args.batch}x{BENCH_MODEL.seq_len}, {args.reps} reps")
    print("| way | ms until the exchange has the bytes (median) | p90 |")
    print("|---|---|---|")
    for name, ms in times.items():
        q = statistics.quantiles(ms, n=10)[-1] if len(ms) > 1 else ms[0]
        print(f"| {name} | {statistics.median(ms):.2f} | {q:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
