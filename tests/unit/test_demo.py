"""The DeMo optimizer: reference parity, error feedback, aggregation, determinism, state, bad input."""

import copy

import pytest
import torch

from demonet.optim import DeMo, Payload, aggregate, dct_matrix
from demonet.wire.digest import param_digest
from tests.reference_demo import ReferenceDeMo


def _params(seed: int, shapes: list[tuple[int, ...]]) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in shapes]


def _set_grads(params: list[torch.nn.Parameter], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 0.01


def _dct_of(p: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(Y*X, h*w) block DCT of a 2-D tensor, computed directly (no demonet transform code)."""
    rows, cols = p.shape
    blocks = p.reshape(rows // h, h, cols // w, w).permute(0, 2, 1, 3).reshape(-1, h, w).double()
    return (dct_matrix(h, torch.float64) @ blocks @ dct_matrix(w, torch.float64).t()).reshape(-1, h * w)


SHAPES = [(128, 192), (64,), (96, 50), (200,)]


@pytest.mark.parametrize("world", [1, 3])
def test_matches_the_reference_semantics(world: int) -> None:
    """Each of `world` peers trains on its own gradients; all apply the same aggregate (§1.7)."""
    ours = [_params(0, SHAPES) for _ in range(world)]
    refs = [_params(0, SHAPES) for _ in range(world)]
    opts = [DeMo(ps, lr=0.01, compression_topk=8, compression_chunk=32) for ps in ours]
    oracles = [ReferenceDeMo(ps, lr=0.01, compression_topk=8, compression_chunk=32) for ps in refs]
    for step in range(6):
        for rank in range(world):
            _set_grads(ours[rank], 100 * step + rank)
            _set_grads(refs[rank], 100 * step + rank)
        before = [p.detach().clone() for p in ours[0]]
        agg = aggregate([opt.compress() for opt in opts])
        for opt in opts:
            opt.apply(agg)
        gathered = [o.step_local() for o in oracles]
        us = [o.apply_gathered(gathered) for o in oracles]
        for p, b, u in zip(ours[0], before, us[0], strict=True):
            our_sign = torch.sign((b - p.detach()) / 0.01)
            agree = (our_sign == torch.sign(u)).float().mean().item()
            assert agree > 0.9999, f"step {step}: sign agreement {agree}"
    for rank in range(world):
        for p, r in zip(ours[rank], refs[rank], strict=True):
            assert torch.allclose(p, r, atol=1e-5)
        assert param_digest(enumerate(ours[rank])) == param_digest(enumerate(ours[0]))


def test_error_feedback_invariant() -> None:
    """momentum before (beta*m + lr*DCT(g)) == momentum after + what was sent, coefficient by coefficient."""
    ps = _params(1, [(64, 128)])
    opt = DeMo(ps, lr=0.1, compression_decay=0.9, compression_topk=5, compression_chunk=32)
    for step in range(3):
        prev = opt.state[ps[0]]["momentum"].double().clone()
        _set_grads(ps, step)
        payload = opt.compress()
        before = 0.9 * prev + 0.1 * _dct_of(ps[0].grad, 32, 32)
        after = opt.state[ps[0]]["momentum"].double()
        sent = torch.zeros_like(after).scatter_add_(1, payload.tensors["0"].idx, payload.tensors["0"].val.double())
        assert torch.allclose(before, after + sent, atol=1e-7)
        assert (sent != 0).sum(dim=1).max() <= 5
        kept = after.abs().max(dim=1).values
        assert torch.all(payload.tensors["0"].val.abs().min(dim=1).values >= kept - 1e-9)  # the largest were sent
        opt.apply(payload)


def test_topk_all_is_lossless() -> None:
    ps = _params(2, [(32, 16), (48,)])
    opt = DeMo(ps, lr=0.5, compression_decay=0.0, compression_topk=10_000, compression_chunk=16, base="sgd")
    _set_grads(ps, 0)
    grads = [p.grad.clone() for p in ps]
    before = [p.detach().clone() for p in ps]
    opt.step()
    for p, b, g in zip(ps, before, grads, strict=True):
        assert torch.allclose(p, b - 0.5 * 0.5 * g, atol=1e-6)  # p -= lr * (lr * g): the whole momentum
        assert torch.count_nonzero(opt.state[p]["momentum"]) == 0


@pytest.mark.parametrize("encoding", ["fp32", "int8", "sign"])
@pytest.mark.parametrize("alpha", [1.0, 0.3])
def test_restore_puts_the_payload_back(encoding: str, alpha: float) -> None:
    ps = _params(3, [(64, 64)])
    opt = DeMo(ps, lr=0.1, compression_decay=0.8, compression_topk=4, compression_chunk=16, encoding=encoding,
               alpha=alpha)
    _set_grads(ps, 0)
    opt.step()
    prev = opt.state[ps[0]]["momentum"].double().clone()
    _set_grads(ps, 1)
    payload = opt.compress()
    assert not torch.allclose(opt.state[ps[0]]["momentum"].double(), 0.8 * prev + 0.1 * _dct_of(ps[0].grad, 16, 16))
    opt.restore(payload)
    assert torch.allclose(opt.state[ps[0]]["momentum"].double(), 0.8 * prev + 0.1 * _dct_of(ps[0].grad, 16, 16),
                          atol=1e-7)


def test_deepcopy_keeps_state_views() -> None:
    ps = _params(3, [(32, 32)])
    opt = DeMo(ps, lr=0.1, compression_chunk=16)
    twin = copy.deepcopy(opt)
    _set_grads([s.param for s in twin._slots], 0)
    twin.step()
    assert torch.count_nonzero(twin.state[twin._slots[0].param]["momentum"]) > 0
    assert torch.count_nonzero(opt.state[ps[0]]["momentum"]) == 0


def test_identical_aggregate_gives_identical_bits() -> None:
    a, b = _params(4, SHAPES), _params(4, SHAPES)
    opt_a = DeMo(a, lr=0.01, compression_topk=8, compression_chunk=32)
    opt_b = DeMo(b, lr=0.01, compression_topk=8, compression_chunk=32)
    other = _params(4, SHAPES)
    opt_other = DeMo(other, lr=0.01, compression_topk=8, compression_chunk=32)
    for step in range(5):
        _set_grads(a, step)
        _set_grads(b, step + 1000)  # different local data: different momentum, same aggregate
        _set_grads(other, step + 2000)
        agg = aggregate([opt_a.compress(), opt_b.compress(), opt_other.compress()])
        opt_a.apply(agg)
        opt_b.apply(agg)
        opt_other.apply(agg)
        assert param_digest(enumerate(a)) == param_digest(enumerate(b))


def test_state_dict_round_trip_resumes_identically() -> None:
    a = _params(5, SHAPES)
    opt_a = DeMo(a, lr=0.01, compression_topk=8, compression_chunk=32, base="adamw", weight_decay=0.1)
    for step in range(3):
        _set_grads(a, step)
        opt_a.step()
    saved = copy.deepcopy(opt_a.state_dict())
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_b = DeMo(b, lr=0.01, compression_topk=8, compression_chunk=32, base="adamw", weight_decay=0.1)
    opt_b.load_state_dict(saved)
    assert torch.count_nonzero(opt_b.state[b[0]]["momentum"]) > 0
    for step in range(3, 6):
        _set_grads(a, step)
        _set_grads(b, step)
        opt_a.step()
        opt_b.step()
    assert param_digest(enumerate(a)) == param_digest(enumerate(b))
    with pytest.raises(ValueError, match="does not fit"):
        DeMo(_params(5, [(8, 8)]), lr=0.01).load_state_dict(saved)


def test_awkward_tensors_train() -> None:
    """3-D and 0-d params, a param without grad, a frozen param, a prime dimension (pad policy)."""
    shapes = [(6, 4, 3, 3), (), (97, 64), (10,)]
    ps = _params(6, shapes)
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    opt = DeMo([*ps, frozen], lr=0.01, compression_topk=4, compression_chunk=16, chunk_policy="pad")
    assert set(opt.compress().tensors) == {"0", "1", "2", "3"}
    assert opt.param_specs()["2"] == ((97, 64), (16, 16))  # 97 is prime: padded to 7 chunks of 16
    target = [torch.zeros(s) for s in shapes]
    losses = []
    for _ in range(60):
        opt.zero_grad()
        loss = sum(((p - t) ** 2).sum() for p, t in zip(ps[:3], target[:3], strict=True))  # ps[3]: no grad
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0]
    assert torch.equal(frozen, torch.ones(3))


def test_per_group_weight_decay_and_lr() -> None:
    a, b = _params(7, [(16, 16)]), _params(7, [(16, 16)])
    opt = DeMo([{"params": a, "weight_decay": 0.5}, {"params": b, "lr": 0.0}], lr=0.1, weight_decay=0.0)
    a[0].grad = torch.zeros(16, 16)
    b[0].grad = torch.ones(16, 16)
    before_a, before_b = a[0].detach().clone(), b[0].detach().clone()
    opt.step()
    assert torch.allclose(a[0], before_a * (1 - 0.1 * 0.5))  # zero grad: only the decay
    assert torch.equal(b[0], before_b)  # lr 0: no change


@pytest.mark.parametrize("base", ["sign", "sgd", "adamw"])
@pytest.mark.parametrize("encoding", ["fp32", "bf16", "fp16", "int8", "sign"])
def test_bases_and_encodings_descend(base: str, encoding: str) -> None:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(32, 32))
    target = torch.randn(32, 32)
    lr = {"sign": 0.04, "sgd": 5.0, "adamw": 0.04}[base]
    opt = DeMo([w], lr=lr, compression_topk=16, compression_chunk=16, base=base, encoding=encoding, alpha=0.5)
    first = float(((w - target) ** 2).mean().detach())
    for _ in range(50):
        opt.zero_grad()
        ((w - target) ** 2).mean().backward()
        opt.step()
    assert float(((w - target) ** 2).mean().detach()) < 0.7 * first


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"compression_topk": 0}, "compression_topk"), ({"compression_topk": -3}, "compression_topk"),
    ({"compression_chunk": 0}, "compression_chunk"), ({"compression_decay": 1.0}, "compression_decay"),
    ({"compression_decay": -0.1}, "compression_decay"), ({"lr": -1.0}, "lr should be > 0"),
    ({"lr": 0.0}, "lr should be > 0, got 0.0"), ({"lr": float("nan")}, "lr should be > 0"), ({"base": "lion"}, "base"),
    ({"alpha": 0.0}, "alpha"), ({"alpha": 1.5}, "alpha"), ({"encoding": "fp8"}, "encoding"),
    ({"chunk_policy": "x"}, "chunk_policy"), ({"weight_decay": -1.0}, "weight_decay"),
])
def test_bad_arguments_raise(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DeMo(_params(8, [(4, 4)]), **{"lr": 0.1, **kwargs})  # type: ignore[arg-type]


def test_options_are_one_validated_object_and_settings_build_the_optimizer() -> None:
    from demonet.config import load_config
    from demonet.optim import DeMoOptions

    opts = DeMoOptions(base="sgd", alpha=0.5, encoding="bf16", chunk_policy="pad")
    a = DeMo(_params(8, [(4, 4)]), lr=0.1, options=opts)
    b = DeMo(_params(8, [(4, 4)]), lr=0.1, base="sgd", alpha=0.5, encoding="bf16", chunk_policy="pad")
    assert a.options == b.options == opts
    with pytest.raises(TypeError, match="not both"):
        DeMo(_params(8, [(4, 4)]), lr=0.1, options=opts, base="sign")
    with pytest.raises(TypeError, match="nesterov"):
        DeMo(_params(8, [(4, 4)]), lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match=r"chunks\['w'\]"):
        DeMoOptions(chunks={"w": (4, 0)})
    cfg = load_config(None, {}, overrides={"optim": {"lr": 0.02, "compression_topk": 5, "base": "sgd",
                                                     "weight_decay": 0.1}})
    c = DeMo.from_settings(_params(8, [(4, 4)]), cfg.optim, chunks={"0": (2, 2)})
    assert (c.defaults["lr"], c.defaults["weight_decay"], c.compression_topk) == (0.02, 0.1, 5)
    assert c.options.base == "sgd" and c.options.chunk_policy == cfg.optim.chunk_policy
    assert c.options.chunks == {"0": (2, 2)}


def test_bad_aggregate_is_rejected_without_change() -> None:
    ps = _params(9, [(16, 16)])
    opt = DeMo(ps, lr=0.1, compression_chunk=8)
    _set_grads(ps, 0)
    payload = opt.compress()
    digest = param_digest(enumerate(ps))
    momentum = opt.state[ps[0]]["momentum"].clone()
    c = payload.tensors["0"]
    bad = [
        Payload(tensors={}),
        Payload(tensors={"0": c, "extra": c}),
        Payload(tensors={"0": type(c)(idx=c.idx[:2], val=c.val[:2], shape=c.shape, chunk=c.chunk)}),
        Payload(tensors={"0": type(c)(idx=c.idx, val=c.val, shape=(16, 17), chunk=c.chunk)}),
        Payload(tensors={"0": type(c)(idx=c.idx, val=c.val, shape=c.shape, chunk=(4, 16))}),
    ]
    for p in bad:
        with pytest.raises(ValueError):
            opt.apply(p)
        with pytest.raises(ValueError):
            opt.restore(p)
    assert param_digest(enumerate(ps)) == digest
    assert torch.equal(opt.state[ps[0]]["momentum"], momentum)


def test_named_parameters_name_the_payload() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2, bias=False))
    opt = DeMo(model.named_parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    assert list(opt.compress().tensors) == ["0.weight", "0.bias", "1.weight"]


def test_restore_only_what_the_aggregate_dropped() -> None:
    ps = _params(10, [(32, 32)])
    opt = DeMo(ps, lr=0.1, compression_topk=6, compression_chunk=16)
    _set_grads(ps, 0)
    payload = opt.compress()
    after = opt.state[ps[0]]["momentum"].clone()
    c = payload.tensors["0"]
    # An aggregate that kept the first 4 of this peer's 6 entries per chunk, plus zero padding.
    kept_idx = torch.cat([c.idx[:, :4], c.idx[:, :1]], dim=1)
    kept_val = torch.cat([c.val[:, :4], torch.zeros(c.idx.shape[0], 1)], dim=1)
    kept = Payload(tensors={"0": type(c)(idx=kept_idx, val=kept_val, shape=c.shape, chunk=c.chunk)})
    opt.restore(payload, kept)
    want = after.clone()
    want.scatter_add_(1, c.idx[:, 4:], c.val[:, 4:])  # the two dropped entries come back
    assert torch.equal(opt.state[ps[0]]["momentum"], want)


def _restored_entry_by_entry(momenta: dict[str, torch.Tensor], payload: Payload, kept: Payload | None,
                             alpha: float) -> dict[str, torch.Tensor]:
    """`DeMo.restore` entry by entry: a payload entry comes back unless the aggregate holds its index
    in the same row with a nonzero value."""
    out = {name: m.clone() for name, m in momenta.items()}
    for name, c in payload.tensors.items():
        for row in range(c.idx.shape[0]):
            held = set() if kept is None else {
                int(i) for i, v in zip(kept.tensors[name].idx[row], kept.tensors[name].val[row], strict=True) if v != 0}
            for i, v in zip(c.idx[row].tolist(), c.val[row], strict=True):
                if i not in held:
                    out[name][row, i] += v * alpha
    return out


@pytest.mark.parametrize("alpha", [1.0, 0.3])
@pytest.mark.parametrize("mixed_k", [False, True], ids=["one-k", "mixed-k"])
def test_restore_of_a_bucket_matches_entry_by_entry(alpha: float, mixed_k: bool) -> None:
    """Several parameters share a bucket (one chunk shape); the aggregate holds another number of entries
    for each, with zero padding. `mixed_k`: one parameter's payload holds fewer entries per row (not
    what `compress` makes: restored parameter by parameter)."""
    shapes = [(64, 64), (32, 64), (96, 32)]
    ps = _params(11, shapes)
    opt = DeMo(ps, lr=0.1, compression_topk=6, compression_chunk=16, alpha=alpha)
    assert len(opt._buckets) == 1
    _set_grads(ps, 0)
    payload = opt.compress()
    if mixed_k:
        c = payload.tensors["1"]
        payload = Payload(tensors={**payload.tensors, "1": type(c)(idx=c.idx[:, :3], val=c.val[:, :3], shape=c.shape,
                                                                    chunk=c.chunk)})
    g = torch.Generator().manual_seed(5)
    kept = {}
    for n, (name, c) in enumerate(payload.tensors.items()):
        # Two of this peer's entries, one random index of the others, then n entries of padding: the index of
        # an entry it dropped (which must come back) with the value 0. n + 3 entries a row.
        other = torch.randint(0, c.totalk, (c.idx.shape[0], 1), generator=g)
        idx = torch.cat([c.idx[:, :2], other, c.idx[:, 2:3].expand(-1, n)], dim=1)
        val = torch.cat([c.val[:, :2], torch.ones(c.idx.shape[0], 1), torch.zeros(c.idx.shape[0], n)], dim=1)
        kept[name] = type(c)(idx=idx, val=val, shape=c.shape, chunk=c.chunk)
    momenta = {s.name: opt._bucket_of[s.name].momentum_BN[s.start:s.stop] for s in opt._slots}
    for held in (Payload(tensors=kept), None):
        want = _restored_entry_by_entry(momenta, payload, held, alpha)
        opt.restore(payload, held)
        for name, m in momenta.items():
            assert torch.equal(m, want[name]), name


_NO_DYNAMO = """
import sys, tempfile
from pathlib import Path
import torch
from demonet.config import load_config
from demonet.coordinator.state import CanonicalState
from demonet.optim import aggregate
from demonet.loop.lifecycle import warm_up
from demonet.train.trainer import Trainer

tmp = Path(tempfile.mkdtemp())
(tmp / "run.toml").write_text('[train]\\nmax_grad_norm = 1.0\\nprecision = "bf16"\\n[optim]\\nbase = "adamw"\\n')
cfg = load_config(tmp / "run.toml")
warm_up()
peer = Trainer.for_run(cfg, data_seed=1, device=torch.device("cpu"), checkpoint=tmp / "peer.pt")
_, payload = peer.train_step()
agg = aggregate([payload])
peer.opt.restore(payload, kept=agg)
peer.opt.apply(agg)
peer.opt.zero_grad()
peer.save({"round": 1})
peer.resume(momentum=True)
state = CanonicalState(cfg)
state.advance(0, agg)
state.save(tmp / "coordinator", {})
state.load(tmp / "coordinator")
print("torch._dynamo" in sys.modules)
"""


def test_a_peer_and_a_coordinator_never_import_dynamo() -> None:
    """torch's optimizers import torch._dynamo at their construction (2 s of CPU, 70 MB); a DeMo peer's and a
    coordinator's steps, checkpoints and state files do not, in a fresh interpreter."""
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-c", _NO_DYNAMO], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "False", done.stdout
