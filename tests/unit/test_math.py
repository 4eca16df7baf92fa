"""Chunk rule, DCT basis and transforms, two-level top-k, aggregation: the pure math."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from demonet.optim import Compressed, Payload, aggregate, chunk_size, dct_matrix, merge_tensor, quantize
from demonet.optim.aggregate import _places_marked, _places_sorted
from demonet.optim.chunking import divisors, reference_chunk_size
from demonet.optim.dct import BASIS_BITS, add_blocks_, encode, to_blocks
from demonet.optim.exact import decode_exact, decode_sign, sqrt_exact
from demonet.optim.topk import topk_abs


@pytest.mark.parametrize(("n", "target", "want"), [
    (12, 3, 3), (12, 4, 4), (12, 5, 4), (100, 7, 5), (100, 26, 25), (100, 101, 100), (1, 1, 1),
    (1_000_000_007, 500_000_000, 1), (50304, 64, 64), (50280, 64, 60), (50257, 64, 29), (16384, 64, 64),
    (100, 64, 50), (97, 64, 1),
])
def test_reference_chunk_rule(n: int, target: int, want: int) -> None:
    assert reference_chunk_size(n, target) == want
    assert chunk_size(n, target, "reference") == want


@pytest.mark.parametrize(("n", "want"), [(50257, 64), (97, 64), (50280, 60), (100, 50), (64, 64), (30, 30)])
def test_pad_policy_never_collapses(n: int, want: int) -> None:
    assert chunk_size(n, 64, "pad") == want


def test_chunk_rule_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="target"):
        reference_chunk_size(10, 0)
    with pytest.raises(ValueError, match="chunk_policy"):
        chunk_size(10, 4, "nearest")
    assert divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36]


def _true_dct(n: int) -> torch.Tensor:
    """The orthonormal DCT-II from libm's cos in float64: an independent path to check the basis against."""
    k = torch.arange(n, dtype=torch.float64)[:, None]
    j = torch.arange(n, dtype=torch.float64)[None, :]
    d = torch.cos(math.pi * (2 * j + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    d[0] = math.sqrt(1.0 / n)
    return d


def test_dct_matrix_is_the_orthonormal_dct2_on_its_grid() -> None:
    # The reference's f_dict[4] (= D.T), from research notes section 1.3.
    truth_f = torch.tensor([[0.5, 0.6533, 0.5, 0.2706], [0.5, 0.2706, -0.5, -0.6533],
                            [0.5, -0.2706, -0.5, 0.6533], [0.5, -0.6533, 0.5, -0.2706]])
    assert torch.allclose(dct_matrix(4).t(), truth_f, atol=1e-4)
    for n in (1, 2, 3, 33, 64, 100):
        d = dct_matrix(n, torch.float64)
        grid = d * 2**BASIS_BITS
        assert torch.equal(grid, grid.round())  # integers times 2^-23
        # Nearest grid point of the true value: within half a step (plus libm's own error, << 2^-40).
        assert (d - _true_dct(n)).abs().max() <= 2.0 ** -(BASIS_BITS + 1) + 2.0**-40
        assert torch.allclose(d @ d.t(), torch.eye(n, dtype=torch.float64), atol=n * 2.0**-BASIS_BITS)
        assert torch.equal(dct_matrix(n), d.float())  # the float32 basis holds the same values


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 40), h=st.integers(1, 8), w=st.integers(1, 8),
       seed=st.integers(0, 2**16))
def test_blockwise_dct_round_trip_with_padding(rows: int, cols: int, h: int, w: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    grid = -(-rows // h) * -(-cols // w)
    blocks = torch.empty(grid, h, w, dtype=torch.float64)
    to_blocks(x, h, w, blocks)
    d_h, d_w = dct_matrix(h, torch.float64), dct_matrix(w, torch.float64)
    coef = torch.zeros_like(blocks)
    encode(blocks, d_h, d_w.t().contiguous(), torch.empty_like(blocks), coef, beta=0.0, alpha=1.0)
    assert torch.allclose(coef, d_h @ blocks @ d_w.t(), atol=1e-12)  # per block: D_h B D_w^T
    energy = (coef**2).sum()
    assert torch.allclose(energy, (x**2).sum(), rtol=1e-5)  # orthonormal to the grid's precision: Parseval
    # Every coefficient, sparse: the exact decode inverts the transform (to the grid's precision).
    idx = torch.arange(h * w).expand(grid, -1).contiguous()
    out = torch.empty_like(blocks)
    decode_exact(idx, coef.view(grid, h * w), d_h, d_w, out, torch.empty(grid * (h * w * (h + w) + h * w),
                                                                         dtype=torch.float64))
    back = torch.zeros_like(x)
    add_blocks_(back, out)
    assert torch.allclose(back, x, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(blocks=st.integers(1, 6), h=st.sampled_from([1, 2, 3, 8, 16]), w=st.sampled_from([1, 4, 7, 16]),
       width=st.integers(1, 40), seed=st.integers(0, 2**16), spread=st.integers(0, 60))
def test_decode_exact_is_the_exact_sum_rounded_once(blocks: int, h: int, w: int, width: int, seed: int,
                                                     spread: int) -> None:
    """decode_exact against the same sum done in exact rational arithmetic (Python ints)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, h * w, (blocks, width), generator=g)
    # values of very different magnitudes, some exact zeros (padding)
    val = torch.randn(blocks, width, generator=g) * torch.pow(2.0, torch.randint(-spread, spread + 1, (blocks, width),
                                                                                 generator=g).float())
    val[:, ::5] = 0.0
    d_h, d_w = dct_matrix(h, torch.float64), dct_matrix(w, torch.float64)
    out = torch.empty(blocks, h, w)
    decode_exact(idx, val, d_h, d_w, out, torch.empty(blocks * (width * (h + w) + h * w), dtype=torch.float64))
    # Independent path: the same rounding of R (to the quantum decode_exact documents), then exact sums.
    from fractions import Fraction
    e_s = max(width - 1, 0).bit_length()
    e_m = int((d_w.abs().max() * 2**BASIS_BITS).item()).bit_length()
    e_h = int((d_h.abs().max() * 2**BASIS_BITS).item())
    for b in range(blocks):
        vmax = max(abs(Fraction(float(v))) for v in val[b])
        bound = vmax * e_h / 2**BASIS_BITS
        e = math.frexp(float(bound))[1] if bound else 0
        q = Fraction(2) ** (e + e_s + e_m - 53)
        for y in range(h):
            for x in range(w):
                total = Fraction(0)
                for s in range(width):
                    i, j = divmod(int(idx[b, s]), w)
                    r = Fraction(float(val[b, s])) * Fraction(float(d_h[i, y]))
                    r_q = round(r / q) * q  # Python's round: half to even, as torch.round
                    total += r_q * Fraction(float(d_w[j, x]))
                assert Fraction(float(total)) == total  # the claim: the exact sum is a float64
                assert float(out[b, y, x]) == float(torch.tensor(float(total), dtype=torch.float64).float())


@settings(max_examples=60, deadline=None)
@given(blocks=st.integers(1, 5), hw=st.sampled_from([(1, 8), (4, 4), (8, 16), (64, 64)]), width=st.integers(1, 40),
       seed=st.integers(0, 2**16), spread=st.integers(0, 40), cancel=st.sampled_from([0.0, 1.0, 2.0**-20, 2.0**-40]))
def test_decode_sign_is_the_sign_of_the_exact_decode(blocks: int, hw: tuple[int, int], width: int, seed: int,
                                                      spread: int, cancel: float) -> None:
    """The fast sign (a float32 GEMM, exact sums only within its error bound) against the sign of
    `decode_exact`, on values that cancel exactly (cancel = 1) or nearly, where a float32 sum's sign
    depends on its order."""
    h, w = hw
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, h * w, (blocks, width), generator=g)
    val = torch.randn(blocks, width, generator=g) * torch.pow(2.0, torch.randint(-spread, spread + 1, (blocks, width),
                                                                                 generator=g).float())
    if cancel:  # every entry s in the first half is undone by entry s + half (to within `cancel`)
        half = width // 2
        idx[:, half:2 * half] = idx[:, :half]
        val[:, half:2 * half] = -val[:, :half] * (1.0 if cancel == 1.0 else 1.0 - cancel)
    d_h, d_w = dct_matrix(h, torch.float64), dct_matrix(w, torch.float64)
    work = torch.empty(blocks * (width * (h + w) + h * w), dtype=torch.float64)
    want = torch.empty(blocks, h, w)
    decode_exact(idx, val, d_h, d_w, want, work)
    got = torch.empty(blocks, h, w)
    decode_sign(idx, val, d_h, d_w, got, work)
    assert torch.equal(got, want.sign())


def test_encode_accumulates_momentum() -> None:
    blocks = torch.randn(5, 4, 8, dtype=torch.float64)
    acc = torch.randn(5, 4, 8, dtype=torch.float64)
    want = 0.9 * acc + 0.1 * (dct_matrix(4, torch.float64) @ blocks @ dct_matrix(8, torch.float64).t())
    encode(blocks, dct_matrix(4, torch.float64), dct_matrix(8, torch.float64).t().contiguous(),
           torch.empty_like(blocks), acc, beta=0.9, alpha=0.1)
    assert torch.allclose(acc, want, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 20), hw=st.sampled_from([(1, 8), (1, 64), (16, 16), (32, 64), (64, 64), (48, 50)]),
       k=st.integers(1, 40), seed=st.integers(0, 2**16), ties=st.booleans())
def test_hierarchical_topk_finds_the_topk_set(rows: int, hw: tuple[int, int], k: int, seed: int, ties: bool) -> None:
    n = hw[0] * hw[1]
    k = min(k, n)
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(rows, n, generator=g)
    if ties:
        m = torch.round(m * 2) / 2  # many equal magnitudes
    idx = topk_abs(m, k, hw[1])
    assert idx.shape == (rows, k)
    assert all(len(set(r.tolist())) == k for r in idx)
    got = m.abs().gather(1, idx).sort(dim=1).values
    want = torch.topk(m.abs(), k, dim=1).values.sort(dim=1).values
    assert torch.equal(got, want)  # the same magnitudes: a valid top-k even where ties pick others


def _c(idx: list[list[int]], val: list[list[float]], chunk: tuple[int, int] = (1, 4)) -> Compressed:
    return Compressed(idx=torch.tensor(idx), val=torch.tensor(val), shape=(len(idx) * chunk[1],), chunk=chunk)


def test_mean_over_contributors_by_hand() -> None:
    a = _c([[0, 2], [1, 3]], [[1.0, 2.0], [3.0, -4.0]])
    b = _c([[2, 3], [1, 0]], [[4.0, 8.0], [5.0, 6.0]])
    m = merge_tensor([a, b])
    dense = torch.zeros(2, 4).scatter_add_(1, m.idx, m.val)
    # chunk 0: coef 0 from a only (1), coef 2 from both ((2+4)/2), coef 3 from b only (8)
    # chunk 1: coef 1 from both ((3+5)/2), coef 3 from a (-4), coef 0 from b (6)
    assert torch.equal(dense, torch.tensor([[1.0, 0.0, 3.0, 8.0], [6.0, 4.0, 0.0, -4.0]]))
    assert m.idx.shape == (2, 3)


def test_zero_chunks_do_not_dilute() -> None:
    zeros = _c([[0, 1]], [[0.0, 0.0]])  # a peer whose chunk was all zeros
    real = _c([[0, 3]], [[2.0, -1.0]])
    dense = lambda c: torch.zeros(1, 4).scatter_add_(1, c.idx, c.val)  # noqa: E731
    assert torch.equal(dense(merge_tensor([zeros, real])), torch.tensor([[2.0, 0.0, 0.0, -1.0]]))
    # The reference's rule, on request: the zero counts and halves the other peer's value.
    assert torch.equal(dense(merge_tensor([zeros, real], count_zeros=True)), torch.tensor([[1.0, 0.0, 0.0, -1.0]]))


def test_aggregate_padding_is_zero_and_rows_unique() -> None:
    g = torch.Generator().manual_seed(0)
    parts = [_c([torch.randperm(64, generator=g)[:5].tolist() for _ in range(7)],
                torch.randn(7, 5, generator=g).tolist(), chunk=(8, 8)) for _ in range(4)]
    m = merge_tensor(parts)
    for row_idx, row_val in zip(m.idx, m.val, strict=True):
        nonzero = row_idx[row_val != 0].tolist()
        assert len(nonzero) == len(set(nonzero))
    dense = torch.zeros(7, 64).scatter_add_(1, m.idx, m.val)
    sums, counts = torch.zeros(7, 64), torch.zeros(7, 64)
    for p in parts:
        sums.scatter_add_(1, p.idx, p.val)
        counts.scatter_add_(1, p.idx, torch.ones_like(p.val))
    assert torch.allclose(dense, sums / counts.clamp(min=1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("count_zeros", [False, True])
def test_the_merge_is_the_bits_of_a_dense_mean_summed_peer_by_peer(dtype: torch.dtype, count_zeros: bool) -> None:
    """The merge works on the entries sent only; a coefficient's mean must still be the bits of the
    dense 0 + v_1 + v_2 + ... (peer order, in float32 or wider) over its count, for peers of different k,
    zeros sent, and rows where nobody sent anything but zeros; with `topk`, the kept entries are those
    bits, at the largest magnitudes."""
    g = torch.Generator().manual_seed(5)
    rows, n = 9, 48
    wide = torch.promote_types(dtype, torch.float32)
    for trial in range(20):
        parts = []
        for _ in range(1 + trial % 5):
            k = int(torch.randint(1, n + 1, (1,), generator=g))
            val = torch.randn(rows, k, generator=g).to(dtype)
            val[torch.rand(rows, k, generator=g) < 0.3] = 0.0
            val[trial % rows] = 0.0
            idx = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(rows)])
            parts.append(Compressed(idx=idx, val=val, shape=(rows * n,), chunk=(6, 8)))
        sums, counts = torch.zeros(rows, n, dtype=wide), torch.zeros(rows, n, dtype=wide)
        for p in parts:
            sums.scatter_add_(1, p.idx, p.val.to(wide))
            counts.scatter_add_(1, p.idx, torch.ones_like(p.val, dtype=wide) if count_zeros else (p.val != 0).to(wide))
        want = (sums / counts.clamp(min=1)).to(dtype)
        m = merge_tensor(parts, count_zeros=count_zeros)
        assert m.val.dtype == dtype
        dense = lambda c: torch.zeros(rows, n, dtype=dtype).scatter_add_(1, c.idx, c.val)  # noqa: E731 (padding adds 0)
        assert torch.equal(dense(m), want)
        assert m.idx.shape[1] == max(int((counts > 0).sum(dim=1).max()), 1)  # the widest union somebody counted
        top = merge_tensor(parts, count_zeros=count_zeros, topk=3)
        assert torch.equal(torch.where(dense(top) != 0, want, 0.0), dense(top))
        best = want.abs().topk(top.idx.shape[1], dim=1).values
        assert torch.equal(top.val.abs().sort(dim=1).values, best.sort(dim=1).values)


def test_aggregate_rejects_mismatched_payloads() -> None:
    a = Payload(tensors={"w": _c([[0]], [[1.0]])})
    b = Payload(tensors={"v": _c([[0]], [[1.0]])})
    with pytest.raises(ValueError, match="different tensors"):
        aggregate([a, b])
    with pytest.raises(ValueError, match="at least one"):
        aggregate([])
    assert aggregate([a]) is a


@pytest.mark.parametrize("encoding", ["fp32", "bf16", "fp16", "int8", "sign"])
def test_quantize_scale_is_exact(encoding: str) -> None:
    val = torch.randn(6, 32) * 1e-6
    deq, scale = quantize(val, encoding)
    assert deq.shape == val.shape and deq.dtype == val.dtype
    if encoding == "int8":
        assert scale is not None
        q = deq / scale
        assert torch.equal(q, torch.round(q)) and q.abs().max() <= 127
    if encoding == "sign":
        assert scale is not None
        assert torch.equal((deq / scale).abs(), torch.ones_like(deq))
        assert torch.equal(torch.sign(deq), torch.where(val < 0, -1.0, 1.0))
    if encoding == "fp16":
        assert scale is not None and math.log2(float(scale)).is_integer()
        assert torch.equal((deq / scale).half().float(), deq / scale)
    assert (deq - val).abs().max() <= val.abs().max()  # within the chunk's range


def test_aggregate_topk_keeps_the_largest_means() -> None:
    a = _c([[0, 1, 2]], [[1.0, -5.0, 0.5]])
    b = _c([[1, 3, 2]], [[-3.0, 2.0, 0.1]])
    m = merge_tensor([a, b], topk=2)  # means: 0 -> 1, 1 -> -4, 2 -> 0.3, 3 -> 2
    dense = torch.zeros(1, 4).scatter_add_(1, m.idx, m.val)
    assert torch.equal(dense, torch.tensor([[0.0, -4.0, 0.0, 2.0]]))
    assert merge_tensor([a, b], topk=10).idx.shape == (1, 4)  # never pads beyond the union


@pytest.mark.parametrize("topk", [None, 3])
def test_aggregate_batches_tensors_exactly_like_one_merge_each(topk: int | None) -> None:
    g = torch.Generator().manual_seed(1)

    def payload(k: int) -> Payload:
        tensors = {}
        for name, rows, chunk in (("a", 5, (4, 4)), ("b", 3, (4, 4)), ("c", 4, (1, 8)), ("d", 2, (4, 4))):
            n = chunk[0] * chunk[1]
            idx = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(rows)])
            tensors[name] = Compressed(idx=idx, val=torch.randn(rows, k, generator=g), shape=(rows * n,), chunk=chunk)
        return Payload(tensors=tensors)

    payloads = [payload(4) for _ in range(3)]
    agg = aggregate(payloads, topk=topk)
    assert list(agg.tensors) == ["a", "b", "c", "d"]
    for name in agg.tensors:
        one = merge_tensor([p.tensors[name] for p in payloads], topk=topk)
        dense = lambda c: torch.zeros(c.idx.shape[0], c.totalk).scatter_add_(1, c.idx, c.val)  # noqa: E731
        assert torch.equal(dense(agg.tensors[name]), dense(one)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sqrt_exact_is_the_correctly_rounded_root(dtype: torch.dtype) -> None:
    """Against the root in float64 rounded once to the dtype (correctly rounded: float64 has more than twice
    the precision plus 2 bits), over every binade that Adam's second moments reach, 0 and subnormals."""
    g = torch.Generator().manual_seed(3)
    finfo = torch.finfo(dtype)
    exps = torch.randint(-40 if dtype == torch.float16 else -126, 30 if dtype != torch.float16 else 15, (200_000,),
                         generator=g).double()
    x = ((1 + torch.rand(200_000, generator=g, dtype=torch.float64)) * torch.pow(2.0, exps)).to(dtype)
    x = torch.cat([x, torch.tensor([0.0, finfo.tiny, finfo.tiny / 4, 1.0, 4.0, 2.0], dtype=dtype)])
    out = torch.empty_like(x)
    assert sqrt_exact(x, out) is out
    want = torch.sqrt(x.double()).to(dtype)
    assert torch.equal(out, want), f"{(out != want).sum()} of {x.numel()} roots off"
    # the float64 reference agrees with Python's (the C library's, correctly rounded) on a sample
    assert all(float(w) == float(torch.tensor(math.sqrt(float(v)), dtype=torch.float64).to(dtype))
               for v, w in zip(x[:500], want[:500], strict=True))


def test_sqrt_exact_in_pieces_covers_every_value(monkeypatch: pytest.MonkeyPatch) -> None:
    import demonet.optim.exact as exact

    monkeypatch.setattr(exact, "_SQRT_PIECE", 1000)  # several pieces and a ragged last one
    x = (torch.rand(10_537, generator=torch.Generator().manual_seed(5)) * 3).view(41, 257)
    out = torch.full_like(x, float("nan"))
    sqrt_exact(x, out)
    assert torch.equal(out, torch.sqrt(x.double()).float())


def test_a_root_one_ulp_off_moves_to_the_nearest() -> None:
    """The correction `sqrt_exact` relies on, from guesses 1 ulp above and below the correctly rounded root."""
    from demonet.optim.exact import _nearest_root

    g = torch.Generator().manual_seed(9)
    x = (torch.rand(100_000, generator=g, dtype=torch.float64) * torch.pow(2.0, torch.randint(-100, 100, (100_000,),
                                                                                                 generator=g))).float()
    x64 = x.double()
    want = torch.sqrt(x64).float()
    for guess in (want, torch.nextafter(want, torch.full_like(want, float("inf"))),
                  torch.nextafter(want, torch.zeros_like(want))):
        assert torch.equal(_nearest_root(x64, guess), want)


@pytest.mark.parametrize("n", [8, 64, 4096])
def test_the_union_is_found_alike_by_sorting_and_by_marking(n: int) -> None:
    """The merge finds each entry's place in its row's union of indices either by sorting the entries or
    by marking them on a dense row of the chunk's n coefficients (`_places`); both give the same places, with
    indices repeated within a peer's row (padding) and across peers, and for one peer or many."""
    g = torch.Generator().manual_seed(n)
    for peers in (1, 2, 5, 64):
        rows = 7
        sent = []
        for _ in range(peers):
            k = min(n, 32)
            idx = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(rows)])
            idx[0, -1] = idx[0, 0]  # padding repeats an index
            sent.append(idx)
        sent_CT = torch.cat(sent, dim=1)
        by_sort, by_mark = _places_sorted(sent_CT), _places_marked(sent_CT, n)
        assert torch.equal(by_sort, by_mark)
        union = torch.zeros_like(sent_CT).scatter_(1, by_sort, sent_CT)
        for r in range(rows):
            want = torch.unique(sent_CT[r])  # sorted
            assert torch.equal(union[r, :len(want)], want)
            assert torch.equal(union[r].gather(0, by_sort[r]), sent_CT[r])
