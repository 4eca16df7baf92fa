"""Benchmark: a Llama-style model from a local config, demonet (a coordinator and 2 peers) against AdamW.

1. Writes the embedded corpus as text and makes a token file with `demonet data tokenize` (bytes).
2. Writes a Llama config (`--hidden`, `--layers`, ...; about 20M parameters by default).
3. Trains the same model (same seed) in one process with AdamW on the same global batch: each step
   takes the next batch of both peers' streams (the peers' own data seeds), so both see the same tokens.
4. Runs `demonet up --task demonet.tasks.hf:causal_lm --peers 2`.
5. Times one peer's step in this process: forward+backward, compress, encode, decode and apply.
Each system runs `--steps` steps, or with `--minutes M` as many steps as fit in M minutes of wall time
(`demonet up` is stopped with SIGTERM then); the losses are compared at the steps both reached.
Prints the table, the losses at equal steps, the bytes per peer per round against the dense fp32
gradient, and writes a plot of both loss curves (`--plot`). Run from the repo root; not a test. `--smoke`: a
1-layer, 32-wide model for 3 steps, a check that the script runs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent


def _llama(folder: Path, args: argparse.Namespace) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256,
        "hidden_size": args.hidden, "intermediate_size": args.intermediate, "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads, "num_key_value_heads": args.heads, "max_position_embeddings": args.seq_len,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "torch_dtype": "float32"}))


def _run_config(path: Path, model: Path, tokens: Path, args: argparse.Namespace) -> None:
    path.write_text(f"""[model]
seq_len = {args.seq_len}
[train]
batch_size = {args.batch_size}
seq_len = {args.seq_len}
seed = 0
[optim]
lr = {args.lr}
encoding = "{args.encoding}"
[net]
round_timeout_s = 600.0
heartbeat_timeout_s = 1200.0
[task]
model = "{model}"
tokens = "{tokens}"
batch_size = {args.batch_size}
seq_len = {args.seq_len}
""")


def _adamw(cfg: Any, steps: int, lr: float, seconds: float | None) -> tuple[list[float], float]:
    """The same task in one process with AdamW on both peers' batches, for `steps` steps or until `seconds`
    have passed; (losses by step, seconds per step)."""
    from demonet.train.data import data_seed
    from demonet.train.task import build_task

    task = build_task(cfg)
    streams = [task.batches(data_seed(cfg.train.seed, f"peer-{i}")) for i in range(2)]
    opt = torch.optim.AdamW(task.model.parameters(), lr=lr, weight_decay=0.0)
    losses, start = [], time.perf_counter()
    for _ in range(steps):
        if seconds is not None and time.perf_counter() - start >= seconds:
            break
        halves = [next(s) for s in streams]
        loss = sum(task.loss(task.model, h) for h in halves) / 2
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, (time.perf_counter() - start) / max(1, len(losses))


def _up(tmp: Path, env: dict[str, str], steps: int, seconds: float | None) -> float:
    """`demonet up` with 2 peers for `steps` rounds, stopped with SIGTERM once `seconds` have passed; its wall s."""
    started = time.perf_counter()
    with open(tmp / "up.err", "w") as err:
        up = subprocess.Popen([sys.executable, "-m", "demonet", "up", "--task", "demonet.tasks.hf:causal_lm",
                               "--config", str(tmp / "run.toml"), "--peers", "2", "--steps", str(steps),
                               "--out", str(tmp / "up"), "--no-progress"], env=env, cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=err)
        try:
            code = up.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            up.send_signal(signal.SIGTERM)  # the run so far stays in metrics.jsonl
            code = up.wait(timeout=120)
            code = 0 if code in (0, 130, -signal.SIGTERM, 128 + signal.SIGTERM) else code  # 130: its interrupt exit
    if code != 0:
        print((tmp / "up.err").read_text()[-3000:], file=sys.stderr)
        raise SystemExit(f"demonet up exited with {code}")
    return time.perf_counter() - started


def _split(cfg: Any, reps: int) -> dict[str, float]:
    """Median seconds of one peer's forward+backward, compress, encode, decode and apply (this process)."""
    from demonet import wire
    from demonet.train.trainer import Trainer
    from demonet.transport import RoundResult

    trainer = Trainer.for_run(cfg, data_seed=1, device=torch.device("cpu"))
    specs = trainer.opt.param_specs()
    times: dict[str, list[float]] = {k: [] for k in ("forward_backward", "compress", "encode", "decode", "apply")}
    for _ in range(reps):
        t0 = time.perf_counter()
        loss = trainer.loss(trainer.model, next(trainer.batches))
        loss.backward()
        t1 = time.perf_counter()
        payload = trainer.opt.compress()
        trainer.opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        data = wire.encode(payload, step=0)
        t3 = time.perf_counter()
        _, decoded = wire.decode(data, expected=specs)
        t4 = time.perf_counter()
        trainer.settle(payload, RoundResult(0, decoded, ("me",), "", False, len(data), len(data)), True)
        t5 = time.perf_counter()
        for key, a, b in (("forward_backward", t0, t1), ("compress", t1, t2), ("encode", t2, t3),
                          ("decode", t3, t4), ("apply", t4, t5)):
            times[key].append(b - a)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="rounds (demonet) and steps (AdamW) (100)")
    parser.add_argument("--minutes", type=float, default=0.0,
                        help="instead: each system trains for as many steps as fit in this many minutes")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1376)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8, help="per peer; AdamW's batch is twice this (8)")
    parser.add_argument("--lr", type=float, default=1e-3, help="DeMo's lr (1e-3)")
    parser.add_argument("--adamw-lr", type=float, default=1e-3, help="AdamW's lr (1e-3)")
    parser.add_argument("--encoding", default="fp32", help="DeMo's payload values: fp32, bf16, ... (fp32)")
    parser.add_argument("--split-reps", type=int, default=5, help="timed steps for the step split (5)")
    parser.add_argument("--plot", type=Path, help="write the loss curves to this PNG")
    parser.add_argument("--smoke", action="store_true", help="a 1-layer, 32-wide model, 3 steps: checks that it runs")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.minutes, args.split_reps = 3, 0.0, 1
        args.hidden, args.intermediate, args.layers, args.heads, args.seq_len, args.batch_size = 32, 64, 1, 2, 32, 2

    from demonet.config import load_config
    from demonet.train.data import load_corpus

    with tempfile.TemporaryDirectory(prefix="task_vs_adamw-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "corpus.txt").write_bytes(bytes(load_corpus(None).tolist()))
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        subprocess.run([sys.executable, "-m", "demonet", "data", "tokenize", str(tmp / "corpus.txt"), "--out",
                        str(tmp / "corpus.tok"), "--no-progress"], check=True, env=env, cwd=ROOT,
                       stdout=subprocess.DEVNULL)
        _llama(tmp / "llama", args)
        _run_config(tmp / "run.toml", tmp / "llama", tmp / "corpus.tok", args)
        cfg = load_config(tmp / "run.toml", {}, {"train": {"task": "demonet.tasks.hf:causal_lm"}})
        from demonet.train.task import build_task

        params = sum(p.numel() for p in build_task(cfg).model.parameters())
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
        split = _split(cfg, args.split_reps)
        torch.set_num_threads(os.cpu_count() or 2)
        steps = 10**6 if args.minutes else args.steps
        seconds = args.minutes * 60 if args.minutes else None
        started = time.perf_counter()
        adamw, adamw_step_s = _adamw(cfg, steps, args.adamw_lr, seconds)
        adamw_s = time.perf_counter() - started
        up_s = _up(tmp, env, steps, seconds)
        rows = [json.loads(line) for line in (tmp / "up" / "metrics.jsonl").read_text().splitlines()]
    by_round: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        by_round.setdefault(int(r["round"]), []).append(r)
    demo = [statistics.fmean(r["loss"] for r in by_round[n]) for n in sorted(by_round)]
    up_bytes = statistics.fmean(r["bytes_up"] for r in rows)
    down_bytes = statistics.fmean(r["bytes_down"] for r in rows)
    dense = 4 * params
    timed = [r for r in rows if r["round"] > 0]
    round_s = statistics.median(r["round_time_s"] for r in timed)
    compute_s = statistics.median(r["compute_s"] for r in timed)
    equal = min(len(adamw), len(demo))  # the steps both reached
    window = max(1, min(10, equal // 5))

    def at(xs: list[float], n: int, w: int) -> float:
        """The mean loss of steps [n - w, n)."""
        return statistics.fmean(xs[max(0, n - w):n])

    budget = f"{args.minutes:g} minutes each" if args.minutes else f"{args.steps} steps each"
    print(f"# demonet vs AdamW: Llama-style, {params / 1e6:.1f}M parameters, vocab 256 (bytes), seq {args.seq_len}, "
          f"global batch {2 * args.batch_size}, {budget}, torch {torch.__version__}, {os.cpu_count()} CPU cores")
    print()
    print(f"| system | steps | loss, first 10 steps | loss, steps {equal - window}-{equal - 1} | wall s | s per step |")
    print("|---|---|---|---|---|---|")
    print(f"| AdamW, 1 process (lr {args.adamw_lr}) | {len(adamw)} | {statistics.fmean(adamw[:10]):.3f} "
          f"| {at(adamw, equal, window):.3f} | {adamw_s:.0f} | {adamw_step_s:.2f} |")
    print(f"| demonet, coordinator + 2 peers (sign, lr {args.lr}, {args.encoding} values) | {len(demo)} "
          f"| {statistics.fmean(demo[:10]):.3f} | {at(demo, equal, window):.3f} | {up_s:.0f} | {round_s:.2f} |")
    print()
    print(f"loss at equal steps ({equal}), demonet / AdamW, mean of the last {window}: "
          f"{at(demo, equal, window) / at(adamw, equal, window):.3f} (goal <= 1.05)")
    for n in sorted({equal // 4, equal // 2, 3 * equal // 4} - {0}):
        w = max(1, min(10, n // 5))
        print(f"  at step {n}: {at(demo, n, w) / at(adamw, n, w):.3f} (mean of the {w} steps before)")
    print(f"bytes per peer per round: up {up_bytes:,.0f}, down {down_bytes:,.0f}; dense fp32 gradient {dense:,}: "
          f"{dense / up_bytes:.0f}x fewer up, {dense / down_bytes:.0f}x fewer down (goal >= 100x)")
    print(f"a peer's round (median): {round_s:.3f} s, of which compute {compute_s:.3f} s and waiting "
          f"{round_s - compute_s:.3f} s (exchange and the slower peer)")
    print("one peer's step in one process, median of", args.split_reps, "(half the cores):",
          ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in split.items()))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        for xs, label in ((adamw, f"AdamW, 1 process, batch {2 * args.batch_size}"),
                          (demo, f"demonet, 2 peers x batch {args.batch_size}")):
            line, = ax.plot(range(len(xs)), xs, linewidth=0.5, alpha=0.35)
            smooth = [at(xs, n + 1, 20) for n in range(len(xs))]  # mean of the last 20 steps
            ax.plot(range(len(xs)), smooth, color=line.get_color(), linewidth=1.5, label=f"{label} (mean of 20)")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.set_title(f"Llama-style {params / 1e6:.1f}M, bytes corpus")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
