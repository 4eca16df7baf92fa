"""Config precedence and validation; the `demonet train` command end to end on a tiny run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from demonet.cli import main
from demonet.config import load_config


def test_precedence_cli_over_env_over_toml(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text("[optim]\nlr = 0.5\ncompression_topk = 4\n[train]\npeers = 3\nsteps = 7\n")
    cfg = load_config(toml, {"DEMONET_OPTIM_LR": "0.25", "DEMONET_TRAIN_PEERS": "5", "HOME": "/root"},
                      {"train": {"peers": 2, "steps": None}})
    assert cfg.optim.lr == 0.25  # env beats TOML
    assert cfg.optim.compression_topk == 4  # TOML beats default
    assert cfg.train.peers == 2  # CLI beats env
    assert cfg.train.steps == 7  # a None flag leaves the lower layers alone


@pytest.mark.parametrize(("toml", "env", "message"), [
    ("[optim]\nlr = -1.0\n", {}, "lr should be > 0"),
    ("[optim]\nlr = 0.0\n", {}, "lr should be > 0, got 0.0"),  # the optimizer's own check (check_lr)
    ("[optim]\ncompression_topk = 0\n", {}, "compression_topk"),
    ("[optim]\nbase = 'lion'\n", {}, "base should be one of"),
    ("[nope]\nx = 1\n", {}, "unknown section"),
    ("[train]\npeerz = 1\n", {}, "unknown setting train.peerz"),
    ("", {"DEMONET_TRAIN_STEPS": "many"}, "train.steps should be a int"),
    ("[train]\nseq_len = 4096\n", {}, "train.seq_len should be <= model.seq_len"),
    ("[model]\nd_model = 100\nn_heads = 3\n", {}, "d_model should be a multiple"),
])
def test_bad_config_is_a_clear_error(tmp_path: Path, toml: str, env: dict[str, str], message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(ValueError, match=message):
        load_config(path, env)


def test_train_command_rejects_bad_flags(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["train", "--peers", "0", "--out", str(tmp_path / "x")]) == 2
    assert "peers should be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()  # nothing was written


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_up_command_rejects_a_bad_state_interval(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                 value: str) -> None:
    assert main(["up", "--peers", "1", "--steps", "1", "--out", str(tmp_path / "x"), "--state-every-s", value]) == 2
    assert "--state-every-s should be >= 0" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()  # nothing was started or written


@pytest.mark.slow
def test_train_command_runs_a_local_cluster(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "demonet", "train", "--peers", "2", "--steps", "6", "--out", str(out),
         "--no-progress", "--threads", "1"],
        capture_output=True, text=True, timeout=300, env={"DEMONET_TRAIN_EVAL_EVERY": "3", "PATH": ""},
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["peers"] == 2 and summary["steps"] == 6
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 12
    assert {line["peer"] for line in lines} == {"p0", "p1"}  # the ids the in-process coordinator gives
    for r in range(6):
        assert len({line["param_digest"] for line in lines if line["round"] == r}) == 1
    assert all(0 < line["bytes_up"] < summary["dense_fp32_bytes"] / 10 for line in lines)
    assert set(summary["val_loss"]) == {"3", "6"}


def test_python_dash_m_demonet_is_the_demonet_command() -> None:
    proc = subprocess.run([sys.executable, "-m", "demonet", "train", "--help"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: demonet train")
    bad = subprocess.run([sys.executable, "-m", "demonet", "nosuchcommand"], capture_output=True, text=True,
                         timeout=120, check=False)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_help_of_the_light_commands_does_not_import_torch() -> None:
    # `demonet --help` took 6 s when every subcommand's module (and torch) was imported to build the parser;
    # only the command asked for is built now (bench/cli_start.py times it).
    probe = ("import sys; sys.argv = ['demonet', *sys.argv[1:]]; from demonet.cli import main\n"
             "try:\n    main()\nfinally:\n    print('torch' in sys.modules, file=sys.stderr)")
    for args in ([], ["up"], ["train"], ["export"], ["keygen"], ["health"], ["status"], ["peer"]):
        proc = subprocess.run([sys.executable, "-c", probe, *args, "--help"], capture_output=True, text=True,
                              timeout=120, check=False)
        assert proc.returncode == 0, (args, proc.stderr)
        assert proc.stdout.startswith(f"usage: demonet {' '.join(args)}".rstrip()), (args, proc.stdout)
        # only peer's flags need its transports, and torch
        assert proc.stderr.strip().endswith(str(args == ["peer"])), (args, proc.stderr)
    peer = subprocess.run([sys.executable, "-m", "demonet", "peer", "--help"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert "--coordinator" in peer.stdout and "--dht" in peer.stdout and "--initial-peers" in peer.stdout
