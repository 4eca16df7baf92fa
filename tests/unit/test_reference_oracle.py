"""Checks of the test oracle itself (tests/reference_demo.py) against hand-known truths."""

from __future__ import annotations

import pytest
import torch

from tests.reference_demo import (
    ReferenceDeMo,
    chunk_size,
    coeff_shape,
    dct_matrix,
    decode,
    decompress,
    encode,
    select_topk,
)

# scipy/torch-dct `_dct(eye(4), norm="ortho")`, i.e. the reference's forward basis f = D.T.
TRUTH_4 = torch.tensor(
    [
        [0.5, 0.6533, 0.5, 0.2706],
        [0.5, 0.2706, -0.5, -0.6533],
        [0.5, -0.2706, -0.5, 0.6533],
        [0.5, -0.6533, 0.5, -0.2706],
    ],
    dtype=torch.float64,
)


def test_dct_matrix_matches_truth_and_is_orthonormal() -> None:
    torch.testing.assert_close(dct_matrix(4).T, TRUTH_4, atol=1e-4, rtol=0)
    for n in (1, 5, 64):
        d = dct_matrix(n)
        torch.testing.assert_close(d @ d.T, torch.eye(n, dtype=torch.float64))


@pytest.mark.parametrize(
    ("n", "target", "expected"),
    [
        (12, 3, 3),
        (12, 4, 4),
        (12, 5, 4),
        (100, 7, 5),
        (100, 26, 25),
        (100, 101, 100),
        (1, 1, 1),
        (50257, 64, 29),
        (50280, 64, 60),
        (50304, 64, 64),
    ],
)
def test_chunk_size_table(n: int, target: int, expected: int) -> None:
    assert chunk_size(n, target) == expected


@pytest.mark.parametrize("shape", [(128, 96), (7, 130), (256,), (67,)])
def test_decode_inverts_encode(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    coeffs = encode(x)
    assert tuple(coeffs.shape) == coeff_shape(shape)
    torch.testing.assert_close(decode(coeffs), x, atol=1e-5, rtol=1e-5)


def test_encode_2d_block_is_d_b_dt() -> None:
    x = torch.randn(8, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    coeffs = encode(x.float(), target=4).double()  # (2, 3, 4, 4)
    block = x[4:8, 8:12]
    torch.testing.assert_close(coeffs[1, 2], dct_matrix(4) @ block @ dct_matrix(4).T, atol=1e-5, rtol=0)


def test_select_topk_psyche_vector() -> None:
    rows = torch.tensor(
        [
            [0.1911, 0.4076, 0.1649, 0.8059],
            [0.2803, 0.9381, 0.9071, 0.2573],
            [0.4070, 0.5765, 0.7226, 0.9486],
            [0.0737, 0.7378, 0.1898, 0.2990],
        ]
    )
    idx, val = select_topk(rows, 2)
    assert [set(r) for r in idx.tolist()] == [{3, 1}, {1, 2}, {3, 2}, {1, 3}]
    torch.testing.assert_close(val, torch.gather(rows, 1, idx))


def test_decompress_means_over_contributors() -> None:
    # Two ranks, one 1-D chunk of 4: rank 0 picks {0, 1}, rank 1 picks {1, 2}; nobody picks 3.
    idx = torch.tensor([[0, 1, 1, 2]])
    val = torch.tensor([[2.0, 4.0, 8.0, -1.0]])
    torch.testing.assert_close(decompress(idx, val, (1, 4)), torch.tensor([[2.0, 6.0, -1.0, 0.0]]))


def test_step_with_all_coefficients_is_sign_sgd() -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 48)), torch.nn.Parameter(torch.randn(40))]
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.randn_like(p)
    lr = 0.01
    opt = ReferenceDeMo(params, lr=lr, compression_topk=64 * 48)
    opt.step()
    for p, p0 in zip(params, before, strict=True):
        assert p.grad is not None
        torch.testing.assert_close(p.detach(), p0 - lr * torch.sign(lr * p.grad), atol=1e-6, rtol=0)
    for delta in opt.delta:  # everything was transmitted, so the error feedback is empty
        assert delta.abs().max().item() < 1e-7


def test_error_feedback_zeroes_selected_coefficients() -> None:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 64))
    p.grad = torch.randn_like(p)
    opt = ReferenceDeMo([p], lr=0.5, compression_topk=8, weight_decay=0.1)
    ((idx, val),) = opt.step_local()
    coeffs = encode(opt.delta[0]).reshape(1, 1, 64 * 64)
    assert coeffs.gather(-1, idx).abs().max().item() < 1e-5
    before = encode(0.5 * p.grad).reshape(1, 1, 64 * 64)
    torch.testing.assert_close(val, before.gather(-1, idx))
    kept = torch.ones(64 * 64, dtype=torch.bool)
    kept[idx.flatten()] = False
    torch.testing.assert_close(coeffs[0, 0, kept], before[0, 0, kept], atol=1e-5, rtol=0)


def test_two_ranks_with_all_coefficients_average_the_momenta() -> None:
    torch.manual_seed(0)
    grads = [torch.randn(32, 16), torch.randn(32, 16)]
    ranks = [
        ReferenceDeMo([torch.nn.Parameter(torch.zeros(32, 16))], lr=0.1, compression_topk=512) for _ in grads
    ]
    for opt, g in zip(ranks, grads, strict=True):
        opt.params[0].grad = g
    gathered = [opt.step_local() for opt in ranks]
    for opt in ranks:
        (u,) = opt.apply_gathered(gathered)
        torch.testing.assert_close(u, 0.1 * (grads[0] + grads[1]) / 2, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(opt.params[0].detach(), -0.1 * torch.sign(u))
