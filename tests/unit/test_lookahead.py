"""The lookahead of overlapped rounds: applying one's own update at once and replacing it with the real
aggregate gives the bits of the plain (non-overlapped) apply from the same state."""

import copy

import pytest
import torch

from demonet.optim import DeMo, Payload, aggregate

SHAPES = [(96, 128), (64,), (40, 50)]


def _pair(base: str, weight_decay: float) -> tuple[list[torch.nn.Parameter], DeMo]:
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in SHAPES]
    return params, DeMo(params, lr=0.01, compression_topk=8, compression_chunk=32, weight_decay=weight_decay,
                        base=base)


def _grads(params: list[torch.nn.Parameter], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 0.01


def _other_payload(opt: DeMo, params: list[torch.nn.Parameter], seed: int) -> Payload:
    """Another peer's payload, from a copy of the optimizer on other gradients."""
    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = DeMo(twin_params, lr=0.01, compression_topk=8, compression_chunk=32, base=opt.options.base)
    _grads(twin_params, seed)
    return twin.compress()


def _bits(params: list[torch.nn.Parameter], opt: DeMo) -> list[torch.Tensor]:
    state = [t.clone() for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return [p.detach().clone() for p in params] + state


@pytest.mark.parametrize(("base", "weight_decay"), [("sign", 0.0), ("adamw", 0.1), ("sgd", 0.01)])
def test_the_aggregate_replaces_the_lookahead_to_the_bit(base: str, weight_decay: float) -> None:
    overlapped_params, overlapped = _pair(base, weight_decay)
    plain_params, plain = _pair(base, weight_decay)
    for step in range(4):
        for ps in (overlapped_params, plain_params):
            _grads(ps, 10 + step)
        own, own_plain = overlapped.compress(), plain.compress()
        agg = aggregate([own, _other_payload(plain, plain_params, 100 + step)])
        before = [p.detach().clone() for p in overlapped_params]
        overlapped.lookahead(aggregate([own]), lr=0.02)
        moved = [p.detach().clone() for p in overlapped_params]
        assert any(not torch.equal(a, b) for a, b in zip(before, moved, strict=True)), "the lookahead applied nothing"
        held = overlapped.held_parameters()
        assert held is not None and all(torch.equal(h, b) for h, b in zip(held.values(), before, strict=True))
        # The aggregate arrives: the contributor restores what it dropped, then applies it.
        overlapped.restore(own, kept=agg)
        overlapped.apply(agg, lr=0.02)
        plain.restore(own_plain, kept=agg)
        plain.apply(agg, lr=0.02)
        assert overlapped.held_parameters() is None
        for a, b in zip(_bits(overlapped_params, overlapped), _bits(plain_params, plain), strict=True):
            assert torch.equal(a, b), f"step {step}: the overlapped apply differs from the plain one"


def test_a_lost_round_undoes_the_lookahead_and_restores_the_payload() -> None:
    params, opt = _pair("adamw", 0.1)
    ref_params, ref = copy.deepcopy((params, opt))
    _grads(params, 1)
    _grads(ref_params, 1)
    payload = opt.compress()
    opt.lookahead(aggregate([payload]))
    opt.restore(payload)  # the round was aborted: the payload goes back, the lookahead is undone
    assert not opt.undo_lookahead(), "restore should have undone the lookahead"
    ref.restore(ref.compress())
    for a, b in zip(_bits(params, opt), _bits(ref_params, ref), strict=True):
        assert torch.equal(a, b)


def test_a_second_lookahead_without_settling_is_refused_and_changes_nothing() -> None:
    params, opt = _pair("sign", 0.0)
    _grads(params, 1)
    payload = opt.compress()
    opt.lookahead(aggregate([payload]))
    state = _bits(params, opt)
    with pytest.raises(RuntimeError, match="already held"):
        opt.lookahead(aggregate([payload]))
    assert all(torch.equal(a, b) for a, b in zip(state, _bits(params, opt), strict=True))
    assert opt.undo_lookahead() and not opt.undo_lookahead()


def test_hold_keeps_the_round_parameters_readable_while_the_lookahead_applies() -> None:
    params, opt = _pair("sign", 0.0)
    _grads(params, 2)
    payload = opt.compress()
    before = [p.detach().clone() for p in params]
    opt.hold()  # the copy a DHT peer serves to joiners, taken before the lookahead changes the live tensors
    with pytest.raises(RuntimeError, match="already held"):
        opt.hold()
    held = opt.held_parameters()
    assert held is not None and all(torch.equal(h, b) for h, b in zip(held.values(), before, strict=True))
    opt.lookahead(aggregate([payload]))
    assert all(torch.equal(h, b) for h, b in zip(held.values(), before, strict=True))
    assert not all(torch.equal(p.detach(), b) for p, b in zip(params, before, strict=True))
    opt.restore(payload)
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before, strict=True))


def _momentum(opt: DeMo) -> list[torch.Tensor]:
    return [s["momentum"].clone() for s in opt.state.values()]


@pytest.mark.parametrize("outcome", ["dropped", "lost"])
def test_an_undone_compress_leaves_the_momentum_as_if_its_gradient_was_dropped(outcome: str) -> None:
    """An overlapped peer compresses round r+1 before round r's outcome is known; when round r is lost,
    the compress is undone and the restores of round r stay, as in the plain order (restore, drop the
    gradient)."""
    params, opt = _pair("adamw", 0.1)
    ref_params, ref = copy.deepcopy((params, opt))
    for ps in (params, ref_params):
        _grads(ps, 1)
    sent, ref_sent = opt.compress(), ref.compress()
    kept = aggregate([_other_payload(opt, params, 7)])  # it holds only some of `sent`'s entries
    opt.lookahead(aggregate([sent]))
    _grads(params, 2)  # round r+1's gradient, compressed before round r's outcome
    early = opt.compress(undoable=True)
    assert any(not torch.equal(a, b) for a, b in zip(_momentum(opt), _momentum(ref), strict=True))
    with pytest.raises(RuntimeError, match="pending"):
        opt.compress(undoable=True)
    opt.restore(sent, kept=kept if outcome == "dropped" else None)
    ref.restore(ref_sent, kept=kept if outcome == "dropped" else None)
    opt.undo_compress()
    for a, b in zip(_bits(params, opt), _bits(ref_params, ref), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="no undoable compress"):
        opt.undo_compress()
    assert early.tensors.keys() == sent.tensors.keys()


def test_a_committed_compress_keeps_the_later_restore_and_a_checkpoint_shows_the_momentum_before_it() -> None:
    params, opt = _pair("sign", 0.0)
    ref_params, ref = copy.deepcopy((params, opt))
    for ps in (params, ref_params):
        _grads(ps, 1)
    sent, ref_sent = opt.compress(), ref.compress()
    kept = aggregate([_other_payload(opt, params, 7)])
    for ps in (params, ref_params):
        _grads(ps, 2)
    before = _momentum(opt)
    early, ref_early = opt.compress(undoable=True), ref.compress()
    opt.restore(sent, kept=kept)
    ref.restore(ref_sent, kept=kept)
    live = _momentum(opt)
    undone = copy.deepcopy(opt)
    undone.undo_compress()
    with opt.momentum_before_compress():  # what a checkpoint of round r+1 must hold: round r settled
        shown = _momentum(opt)
    assert all(torch.equal(a, b) for a, b in zip(shown, _momentum(undone), strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(shown, before, strict=True)), "the restore is missing"
    assert all(torch.equal(a, b) for a, b in zip(live, _momentum(opt), strict=True)), "the context changed it"
    opt.commit_compress()
    assert all(torch.equal(a, b) for a, b in zip(_momentum(opt), _momentum(ref), strict=True))
    assert all(torch.equal(a.val, b.val) for a, b in zip(early.tensors.values(), ref_early.tensors.values(),
                                                         strict=True))
    with pytest.raises(RuntimeError, match="no undoable compress"):
        opt.undo_compress()
