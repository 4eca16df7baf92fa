"""The Hugging Face `Trainer` as one peer of a demonet run (docs/own-loop.md, docs/tasks.md).

The coordinator trains the built-in Hugging Face task (`demonet.tasks.hf:causal_lm`), so it serves the
parameters of the model its `[task] model` folder configures. This script builds the same model, hands
the Trainer `run.optimizer(model)` as its optimizer with a constant schedule, and feeds it windows of a
token file; each Trainer step is one round of the run. Needs `pip install 'demonet[hf]' accelerate`.

    python examples/hf_trainer.py --write-model models/tiny-llama --vocab-size 512   # a tiny Llama config
    # run.toml: [train] task = "demonet.tasks.hf:causal_lm"
    #           [task] model = "models/tiny-llama", tokens = "corpus.tok", batch_size = 4, seq_len = 64
    DEMONET_TOKEN=... demonet coordinator --listen 0.0.0.0:7450 --config run.toml
    DEMONET_TOKEN=... python examples/hf_trainer.py --coordinator HOST:7450 --peer-id alice --out runs/alice

The model folder and the token file default to the run's `[task]` table (paths as seen from here).
Without either a `--model` or a run's folder, the script writes the tiny Llama config itself (the
coordinator must then serve that same model, e.g. from `--write-model`).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, Trainer, TrainerCallback, TrainingArguments

import demonet
from demonet.train.data import data_seed
from demonet.train.tokens import TokenBatches, TokenFile


def write_tiny_llama(folder: Path, vocab_size: int) -> Path:
    """A Llama-style config.json small enough for a test: 2 layers, 32 wide, 2 heads, tied embeddings."""
    LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                tie_word_embeddings=True).save_pretrained(folder)
    return folder


class TokenWindows(torch.utils.data.IterableDataset[dict[str, torch.Tensor]]):
    """Endless examples of `seq_len` + 1 tokens from the token file's training part, drawn as demonet's peers
    draw them; labels are the inputs (the model shifts them: the next-token loss over `seq_len` positions)."""

    def __init__(self, path: str, seq_len: int, seed: int) -> None:
        self.tokens_N, _ = TokenFile.open(path).split()
        self.seq_len, self.seed = seq_len, seed

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for x_BT, y_BT in TokenBatches(self.tokens_N, batch_size=1, seq_len=self.seq_len, seed=self.seed):
            ids_T1 = torch.cat([x_BT[0], y_BT[0, -1:]])  # (T + 1,)
            yield {"input_ids": ids_T1, "labels": ids_T1}


class _LastLoss:
    value: torch.Tensor | None = None


class _LossTrainer(Trainer):
    """A Trainer that keeps each step's loss, for the round's metrics row (`opt.step(loss=...)`)."""

    def __init__(self, *args: Any, last: _LastLoss, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.last = last

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss: torch.Tensor = super().training_step(*args, **kwargs)
        self.last.value = loss
        return loss


def _report_losses(opt: Any, last: _LastLoss) -> None:
    """The Trainer calls `opt.step()` bare: make it report the step's loss with the round. A bound method, as
    torch's schedulers wrap one (so call this before building the schedule)."""
    plain = type(opt).step

    def step(self: Any, closure: Any = None) -> Any:
        return plain(self, closure, loss=last.value)

    opt.step = types.MethodType(step, opt)


class _StopWithTheRun(TrainerCallback):
    def __init__(self, run: Any) -> None:
        self.run = run

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        control.should_training_stop = self.run.done
        return control


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--coordinator", help="HOST:PORT of the run's coordinator")
    parser.add_argument("--peer-id", help="this peer's id")
    parser.add_argument("--out", help="folder for the metrics rows, the checkpoint and the Trainer's output")
    parser.add_argument("--model", help="a model folder with config.json (default: the run's [task] model)")
    parser.add_argument("--tokens", help="a token file (default: the run's [task] tokens)")
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    parser.add_argument("--write-model", metavar="DIR", help="only write the tiny Llama config to DIR and exit")
    parser.add_argument("--vocab-size", type=int, default=512, help="with --write-model")
    args = parser.parse_args()
    if args.write_model:
        print(write_tiny_llama(Path(args.write_model), args.vocab_size))
        return 0
    if not args.coordinator or not args.peer_id:
        parser.error("--coordinator and --peer-id are needed to join a run")
    if args.threads:
        torch.set_num_threads(args.threads)

    with demonet.join(coordinator=args.coordinator, peer_id=args.peer_id, out=args.out) as run, \
            tempfile.TemporaryDirectory() as scratch:
        cfg, table = run.config, run.config.task
        tokens = args.tokens or table.get("tokens")
        if not tokens:
            raise SystemExit("no token file: give --tokens (the run's [task] table names none)")
        seq_len, batch_size = int(table.get("seq_len", 128)), int(table.get("batch_size", 8))
        folder = args.model or table.get("model") or write_tiny_llama(Path(scratch) / "tiny-llama",
                                                                      TokenFile.open(tokens).header.vocab_size)
        torch.manual_seed(cfg.train.seed)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder, local_files_only=True)).float()
        opt = run.optimizer(model)  # the run's parameters are in the model now
        last = _LastLoss()
        _report_losses(opt, last)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)  # constant: every peer applies alike
        training = TrainingArguments(
            output_dir=args.out or str(Path(scratch) / "trainer"), max_steps=cfg.train.steps,
            per_device_train_batch_size=batch_size, max_grad_norm=0.0,  # no clipping, as demonet's own peers
            save_strategy="no", report_to="none", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
            dataloader_pin_memory=False)
        data = TokenWindows(tokens, seq_len, seed=data_seed(cfg.train.seed, args.peer_id))
        trainer = _LossTrainer(model=model, args=training, train_dataset=data, optimizers=(opt, schedule),
                               callbacks=[_StopWithTheRun(run)], last=last)
        trainer.train()
        print(json.dumps({"peer": args.peer_id, "round": run.round, "digest": run.digest, "reason": run.reason,
                          "loss": None if last.value is None else float(last.value)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
