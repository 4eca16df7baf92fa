"""`demonet export` and the `--init` file check (demonet.coordinator.weights): a round trip that keeps every
bit, and bad state folders and files refused with nothing written."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, safe_open, save_file

from demonet.cli import main as demonet
from demonet.config import Config, load_config
from demonet.coordinator.state import STATE_FILE, CanonicalState
from demonet.coordinator.weights import export, read_init, read_state
from demonet.errors import WeightsFileError
from demonet.wire.digest import legacy_param_digest, param_digest

_TINY = {"model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 32}, "train": {"seq_len": 32}}


@pytest.fixture(scope="module")
def cfg() -> Config:
    return load_config(None, {}, _TINY)


def _saved_state(cfg: Config, state_dir: Path, round: int = 7) -> CanonicalState:
    """A state as a coordinator saves it after some rounds: parameters off the seeded init (with a -0.0 and a
    subnormal, which a lossy copy would lose), the round counter, an aggregate."""
    state = CanonicalState(cfg)
    gen = torch.Generator().manual_seed(1)
    perturbed = {n: p.detach() + 0.01 * torch.randn(p.shape, generator=gen) for n, p in state.params.items()}
    first = next(iter(perturbed))
    perturbed[first].view(-1)[:2] = torch.tensor([-0.0, 1e-40])
    state.set_params(perturbed)
    state.save(state_dir, {"rounds": {"round": round, "members": ["a"], "joiners": []}, "counters": {}})
    return state


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def test_export_round_trip_is_bit_exact(cfg: Config, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = _saved_state(cfg, tmp_path / "state")
    out = tmp_path / "model.safetensors"
    assert demonet(["export", "--state-dir", str(tmp_path / "state"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "round 7" in printed and state.digest in printed, printed
    loaded = load_file(str(out))
    assert set(loaded) == set(state.params)
    for name, p in state.params.items():
        got = loaded[name]
        assert (got.dtype, got.shape, got.device.type) == (p.dtype, p.shape, "cpu"), name
        assert torch.equal(_bits(got), _bits(p.detach())), name
    assert param_digest((n, loaded[n]) for n in state.params) == state.digest
    with safe_open(str(out), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "demonet.round": "7", "demonet.digest": state.digest}
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors", "state"]  # no temp file left


def test_export_to_a_name_without_the_suffix_writes_a_folder(cfg: Config, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    # `--out hfdir` looks like a folder: it is one, with model.safetensors in it (the name from_pretrained reads).
    state = _saved_state(cfg, tmp_path / "state")
    out = tmp_path / "hfdir"
    argv = ["export", "--state-dir", str(tmp_path / "state"), "--out", str(out)]
    assert demonet(argv) == 0
    assert str(out / "model.safetensors") in capsys.readouterr().out
    assert out.is_dir() and os.listdir(out) == ["model.safetensors"]
    loaded = load_file(str(out / "model.safetensors"))
    assert param_digest((n, loaded[n]) for n in state.params) == state.digest
    assert demonet(argv) == 2 and "exists; --force" in capsys.readouterr().err  # the file in it is kept
    assert demonet([*argv, "--force"]) == 0
    afile = tmp_path / "afile"
    afile.write_bytes(b"keep me")
    assert demonet([*argv[:-1], str(afile)]) == 2
    assert "is a file" in capsys.readouterr().err and afile.read_bytes() == b"keep me"
    missing = tmp_path / "new" / "dir"
    assert demonet(["export", "--state-dir", str(tmp_path / "nope"), "--out", str(missing)]) == 2
    assert not (tmp_path / "new").exists()  # a bad state makes no folder


def test_export_refuses_to_overwrite_without_force(cfg: Config, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    state = _saved_state(cfg, tmp_path / "state")
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"keep me")
    argv = ["export", "--state-dir", str(tmp_path / "state"), "--out", str(out)]
    assert demonet(argv) == 2
    assert "exists" in capsys.readouterr().err and out.read_bytes() == b"keep me"
    assert demonet([*argv, "--force"]) == 0
    assert param_digest((n, t) for n, t in ((n, load_file(str(out))[n]) for n in state.params)) == state.digest


def _damaged_states(cfg: Config, root: Path) -> dict[str, tuple[Path, str]]:
    """name -> (a state folder, words the error must contain)."""
    good = root / "good"
    _saved_state(cfg, good)
    data = (good / STATE_FILE).read_bytes()
    cases: dict[str, tuple[Path, str]] = {"missing folder": (root / "nope", "no such folder")}
    (root / "empty").mkdir()
    cases["no state file"] = (root / "empty", "no coordinator state")
    for name, content in {"truncated": data[: len(data) // 2], "empty file": b"", "garbage": bytes(range(256)) * 4,
                          "text": b"hello\n"}.items():
        (root / name).mkdir()
        (root / name / STATE_FILE).write_bytes(content)
        cases[name] = (root / name, "damaged or not a coordinator state")
    (root / "other").mkdir()
    torch.save({"model": torch.zeros(3)}, root / "other" / STATE_FILE)
    cases["another checkpoint"] = (root / "other", "no 'params'")
    body = torch.load(good / STATE_FILE, weights_only=False)
    next(iter(body["params"].values())).view(-1)[0] += 1.0  # bit rot: the digest no longer matches
    (root / "tampered").mkdir()
    torch.save(body, root / "tampered" / STATE_FILE)
    cases["tampered"] = (root / "tampered", "do not match their digest")
    return cases


def test_export_refuses_a_missing_or_damaged_state(cfg: Config, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    cases = _damaged_states(cfg, tmp_path / "states")
    out = tmp_path / "out"
    out.mkdir()
    for case, (state_dir, words) in cases.items():
        with pytest.raises(WeightsFileError, match=words):
            export(state_dir, out / "model.safetensors")
        assert demonet(["export", "--state-dir", str(state_dir), "--out", str(out / "model.safetensors")]) == 2
        err = capsys.readouterr().err
        assert "demonet export:" in err and words in err, (case, err)
        assert os.listdir(out) == [], case  # nothing written, no temp file


def test_export_without_safetensors_says_how_to_install_it(cfg: Config, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    _saved_state(cfg, tmp_path / "state")
    monkeypatch.setitem(sys.modules, "safetensors", None)  # None in sys.modules: the import raises ImportError
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(WeightsFileError, match=r"demonet\[hf\]"):
        export(tmp_path / "state", tmp_path / "model.safetensors")
    assert not (tmp_path / "model.safetensors").exists()


def test_read_state_gives_the_saved_round_and_digest(cfg: Config, tmp_path: Path) -> None:
    state = _saved_state(cfg, tmp_path, round=3)
    saved = read_state(tmp_path)
    assert (saved.round, saved.digest, list(saved.params)) == (3, state.digest, list(state.params))


def test_read_state_of_protocol_1_gives_the_digest_recomputed(cfg: Config, tmp_path: Path) -> None:
    state = _saved_state(cfg, tmp_path, round=3)
    body = torch.load(tmp_path / STATE_FILE, map_location="cpu", weights_only=False)
    torch.save({**body, "digest": legacy_param_digest(state.params.items())}, tmp_path / STATE_FILE)
    assert read_state(tmp_path).digest == state.digest == param_digest(state.params.items())


def test_read_init_accepts_an_exact_match_in_the_model_order(cfg: Config, tmp_path: Path) -> None:
    state = CanonicalState(cfg)
    tensors = {n: p.detach() * 2 for n, p in reversed(list(state.params.items()))}
    save_file(tensors, str(tmp_path / "init.safetensors"))
    got = read_init(tmp_path / "init.safetensors", state.params)
    assert list(got) == list(state.params)
    state.set_params(got)
    assert state.digest == param_digest((n, tensors[n]) for n in state.params)
    assert all(torch.equal(state.params[n].detach(), tensors[n]) for n in tensors)


def test_read_init_names_the_first_difference(cfg: Config, tmp_path: Path) -> None:
    params = CanonicalState(cfg).params
    names = list(params)
    base = {n: p.detach().clone() for n, p in params.items()}
    cases = {
        "missing": ({n: t for n, t in base.items() if n != names[3]}, f"'{names[3]}' is missing"),
        "extra": ({**base, "head.weight": torch.zeros(2)}, "'head.weight' is not a parameter"),
        "shape": ({**base, names[2]: torch.zeros(33)}, f"'{names[2]}' is torch.float32 (33,) in the file"),
        "dtype": ({**base, names[0]: base[names[0]].to(torch.bfloat16)}, f"'{names[0]}' is torch.bfloat16"),
        "nan": ({**base, names[1]: torch.full_like(base[names[1]], float("nan"))}, f"'{names[1]}' holds NaN"),
    }
    for case, (tensors, words) in cases.items():
        path = tmp_path / f"{case}.safetensors"
        save_file(tensors, str(path))
        with pytest.raises(WeightsFileError, match=re.escape(words)):
            read_init(path, params)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(WeightsFileError, match="not a readable safetensors file"):
        read_init(tmp_path / "junk.safetensors", params)
    with pytest.raises(WeightsFileError, match="no such file"):
        read_init(tmp_path / "absent.safetensors", params)
