"""Merge the sparse payloads of several peers into one aggregate payload.

Math layer: imports torch only.

Shape legend: C = chunks of one tensor, K = entries per chunk, N = h * w coefficients per chunk,
U = entries per chunk of the merged union.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .payload import Compressed, Payload

__all__ = ["aggregate", "aggregate_clipped", "merge_tensor", "payload_norm"]

_BLOCK_ENTRIES = 2**18  # entries sent (all peers together) per merged block: 1 MiB per fp32 work buffer


def merge_tensor(parts: Sequence[Compressed], *, count_zeros: bool = False, topk: int | None = None) -> Compressed:
    """Merge one tensor's entries from several peers: union of indices, mean over contributors.

    Each coefficient is averaged over the peers that sent it, as the reference's
    ``scatter_reduce(mean, include_self=False)`` does; coefficients nobody sent stay 0. Sums run
    peer by peer in the given order with unique indices per row, so the result is the same bits on
    every device (no atomics race).

    Args:
        parts: the tensor's `Compressed` from each peer, same shape and chunk.
        count_zeros: count a peer that sent exactly 0 as a contributor (the reference does; it
            halves other peers' values wherever one peer's chunk was all zeros). Off by default.
        topk: keep only this many merged entries per chunk, the largest |mean|, so that the
            aggregate does not grow with the number of peers. Peers restore what was dropped of
            their own payloads (`DeMo.restore(payload, kept=aggregate)`). None keeps the union.

    Returns:
        (C, U) entries, U the largest union over chunks; shorter rows are padded with value 0.
    """
    first = parts[0]
    for part in parts[1:]:
        if part.shape != first.shape or part.chunk != first.chunk or part.idx.shape[0] != first.idx.shape[0]:
            raise ValueError(
                f"cannot merge tensors of shape {part.shape} chunk {part.chunk} and {first.shape} {first.chunk}")
    idx_CU, val_CU = _merge_rows([p.idx for p in parts], [p.val for p in parts], count_zeros=count_zeros, topk=topk,
                                 n=first.totalk)
    return Compressed(idx=idx_CU, val=val_CU, shape=first.shape, chunk=first.chunk)


def _merge_rows(idx_list: Sequence[torch.Tensor], val_list: Sequence[torch.Tensor], *, count_zeros: bool,
                topk: int | None, n: int | None = None, weights: Sequence[float] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """`merge_tensor` on bare (C, K_peer) rows of coefficient indices. Every op is row-wise, so rows of
    several tensors can be merged in one call and split afterwards. `n`: the coefficients per chunk
    (the indices are below it), where known.

    The work is on the entries sent (T per row, every peer's K together): each row's union of indices,
    in index order, is found from them (`_places`), and each peer's entries are summed at their place in
    that union, peer by peer in the given order. Where the dense sum would be 0 + v_1 + v_2 + ... in that
    order for a coefficient, so is this one: the same bits, on every device. On the CPU one scatter adds
    every peer's entries, a row's in the order given (the CPU kernel walks a row's entries one by one);
    elsewhere one scatter per peer, whose places in a row are unique, so no atomics race.

    `weights`: each peer's weight in the mean (its samples): a coefficient's mean is then the sum of w_i * v_i
    over the peers that sent it, divided by the sum of their w_i; each product is one rounding, and the sums
    run in the same order as without weights. None: every weight 1 (the same bits as weights of 1).
    """
    num_chunks = idx_list[0].shape[0]
    out_dtype = val_list[0].dtype
    dtype = torch.promote_types(out_dtype, torch.float32)
    device = val_list[0].device
    sent_CT = torch.cat(list(idx_list), dim=1)
    width_t = sent_CT.shape[1]
    place_CT = _places(sent_CT, n)
    union_CT = torch.zeros_like(sent_CT).scatter_(1, place_CT, sent_CT)  # a place's entries share their index
    sums_CT = torch.zeros(num_chunks, width_t, dtype=dtype, device=device)
    counts_CT = torch.zeros(num_chunks, width_t, dtype=dtype, device=device)
    if device.type == "cpu":
        val_CT = torch.cat([val.to(dtype) for val in val_list], dim=1)
        count_CT = torch.ones_like(val_CT) if count_zeros else (val_CT != 0).to(dtype)
        if weights is not None:  # each peer's entries times its weight: one rounding each
            w_CT = torch.cat([torch.full_like(val, w, dtype=dtype) for val, w in zip(val_list, weights, strict=True)],
                             dim=1)
            val_CT, count_CT = val_CT * w_CT, count_CT * w_CT
        sums_CT.scatter_add_(1, place_CT, val_CT)
        counts_CT.scatter_add_(1, place_CT, count_CT)
    else:
        start = 0
        for i, (idx_CK, val) in enumerate(zip(idx_list, val_list, strict=True)):
            place_CK = place_CT[:, start:start + idx_CK.shape[1]]
            start += idx_CK.shape[1]
            val_CK = val.to(dtype)
            weight_CK = torch.ones_like(val_CK) if count_zeros else (val_CK != 0).to(dtype)
            if weights is not None:
                val_CK, weight_CK = val_CK * weights[i], weight_CK * weights[i]
            sums_CT.scatter_add_(1, place_CK, val_CK)
            counts_CT.scatter_add_(1, place_CK, weight_CK)

    # Keep the places that somebody counted (a place past the row's union has no count), in index order;
    # the rest go to a spare column that is dropped. Kept ranks are unique, so no race.
    keep_CT = counts_CT > 0
    num_kept_C = keep_CT.sum(dim=1)
    width = max(int(num_kept_C.max()) if num_chunks else 0, 1)
    rank_CT = torch.where(keep_CT, keep_CT.cumsum(dim=1) - 1, width)
    mean_CT = sums_CT.div_(counts_CT.clamp_(min=1))
    idx_CU = torch.zeros(num_chunks, width + 1, dtype=torch.int64, device=device).scatter_(1, rank_CT, union_CT)
    val_CU = torch.zeros(num_chunks, width + 1, dtype=dtype, device=device).scatter_(1, rank_CT, mean_CT)
    idx_CU, val_CU = idx_CU[:, :width], val_CU[:, :width]
    valid_CU = torch.arange(width, device=device)[None, :] < num_kept_C[:, None]
    idx_CU = torch.where(valid_CU, idx_CU, idx_CU[:, :1])  # padding repeats a real index, value 0 (never written)
    val_CU = val_CU.to(out_dtype)
    if topk is not None and width > topk:
        best_CK = torch.topk(val_CU.abs(), topk, dim=1, sorted=False).indices
        idx_CU, val_CU = idx_CU.gather(1, best_CK), val_CU.gather(1, best_CK)
    return idx_CU, val_CU


def _places(sent_CT: torch.Tensor, n: int | None) -> torch.Tensor:
    """Each entry's place in its row's union of indices, the union sorted by index: (C, T) int64. The
    entries are sorted per row (C * T log T), or, where a row's n coefficients are few next to that (many
    peers, or small chunks), marked on a dense row (C * n): the same places either way."""
    width_t = sent_CT.shape[1]
    if n is not None and 2 * n <= width_t * width_t.bit_length():
        return _places_marked(sent_CT, n)
    return _places_sorted(sent_CT)


def _places_sorted(sent_CT: torch.Tensor) -> torch.Tensor:
    sorted_CT, order_CT = torch.sort(sent_CT, dim=1, stable=True)  # faster on the sorted rows payloads arrive in
    first_CT = torch.ones_like(sorted_CT, dtype=torch.bool)
    first_CT[:, 1:] = sorted_CT[:, 1:] != sorted_CT[:, :-1]
    place_CT = first_CT.cumsum(dim=1) - 1  # each sorted entry's place in its row's union
    return torch.empty_like(place_CT).scatter_(1, order_CT, place_CT)  # the same places, as the entries were sent


def _places_marked(sent_CT: torch.Tensor, n: int) -> torch.Tensor:
    mark_CN = torch.zeros(sent_CT.shape[0], n, dtype=torch.bool, device=sent_CT.device).scatter_(1, sent_CT, True)
    return (mark_CN.cumsum(dim=1) - 1).gather(1, sent_CT)  # the coefficients sent before it in index order


def payload_norm(payload: Payload) -> float:
    """The L2 norm of all of a payload's values together, summed in float64 in tensor order."""
    total = torch.zeros((), dtype=torch.float64)
    for c in payload.tensors.values():
        total += c.val.to(torch.float64).square().sum()
    return float(total.sqrt())


def aggregate(payloads: Sequence[Payload], *, count_zeros: bool = False, topk: int | None = None,
              clip: bool = False) -> Payload:
    """The round's aggregate: every tensor merged with `merge_tensor`.

    A single payload is returned as it is (its own mean; `topk` is meant to be at least the peers'
    k). `topk`: see `merge_tensor`. `clip`: first scale every payload whose norm exceeds the round's
    median norm down to it (see `aggregate_clipped`); off, the payloads are merged as they are.
    All payloads must hold the same tensor names in the same order; a mismatch raises ValueError
    (the wire layer validates peers' payloads against the model first).
    """
    return aggregate_clipped(payloads, count_zeros=count_zeros, topk=topk, clip=clip)[0]


def aggregate_clipped(payloads: Sequence[Payload], *, count_zeros: bool = False, topk: int | None = None,
                      clip: bool = True, rounding: Callable[[torch.Tensor], torch.Tensor] | None = None,
                      weights: Sequence[float] | None = None) -> tuple[Payload, list[float]]:
    """`aggregate`, also returning each payload's clip factor in (0, 1] (all 1.0 without `clip`).

    With `clip`, every payload whose L2 norm (all its values together) exceeds the median norm of
    `payloads` is scaled down to that median before the merge: robust aggregation against poisoned but
    well-formed updates (Templar's median-norm clipping), so a peer that scales its payload by 1000 or
    sends noise of a large norm weighs no more than a typical peer. The median of an even count is the
    lower middle value, so with two payloads the smaller norm bounds both. A clipped payload's values
    are scaled in float32. The norms are taken on the blocks of values the merge concatenates anyway
    (one reduction per block and payload, in float64, in order), so clipping costs next to nothing and
    is deterministic: the same payloads in the same order give the same bits.

    `rounding`: an elementwise function applied to the merged values (e.g. a rounding through an encoding
    without a scale), once for each block of tensors merged together rather than once a tensor: the same
    bits as applying it to each merged tensor, in a few calls. A single payload is returned as it is.

    `weights`: each payload's weight in every coefficient's mean (a peer's samples, already bounded by the
    caller), applied after the clip; None: an equal weight for all.
    """
    if not payloads:
        raise ValueError("aggregate needs at least one payload")
    if weights is not None and (len(weights) != len(payloads) or not all(w > 0 for w in weights)):
        raise ValueError(f"weights should be one positive number per payload, got {list(weights)}")
    factors = [1.0] * len(payloads)
    if len(payloads) == 1:
        return payloads[0], factors
    names = list(payloads[0].tensors)
    for payload in payloads[1:]:
        if list(payload.tensors) != names:
            raise ValueError("payloads hold different tensors; validate them against the model first")
    # Tensors that share a chunk shape and every peer's k are merged as one block of rows: the same
    # result as one merge per tensor (every op is row-wise), with far fewer small torch calls. A
    # block holds at most _BLOCK_ENTRIES entries sent, so its work buffers stay in cache.
    blocks: list[tuple[tuple[int, int], list[str]]] = []
    open_blocks: dict[tuple[object, ...], tuple[tuple[int, int], list[str], int]] = {}
    for name in names:
        parts = [p.tensors[name] for p in payloads]
        first = parts[0]
        for part in parts[1:]:
            if part.shape != first.shape or part.chunk != first.chunk:
                raise ValueError(f"cannot merge {name}: shape {part.shape} chunk {part.chunk} and "
                                 f"{first.shape} {first.chunk}")
        key = (first.chunk, first.val.dtype, first.val.device, tuple(tuple(p.idx.shape[1:]) for p in parts))
        size = first.idx.shape[0] * sum(int(p.idx.shape[1]) for p in parts)
        current = open_blocks.get(key)
        if current is None or current[2] + size > _BLOCK_ENTRIES:
            current = (first.chunk, [], 0)
            blocks.append((current[0], current[1]))
        current[1].append(name)
        open_blocks[key] = (current[0], current[1], current[2] + size)
    vals = [[torch.cat([p.tensors[name].val for name in group]) for p in payloads] for _, group in blocks]
    if clip:
        sq = [torch.zeros((), dtype=torch.float64) for _ in payloads]
        for block in vals:
            for i, v in enumerate(block):
                sq[i] += v.square().sum(dtype=torch.float64)
        norms = [float(x.sqrt()) for x in sq]
        median = sorted(norms)[(len(norms) - 1) // 2]
        factors = [median / n if n > median else 1.0 for n in norms]
        vals = [[v if f == 1.0 else (v.float() * f).to(v.dtype) for v, f in zip(block, factors, strict=True)]
                for block in vals]
    merged: dict[str, Compressed] = {}
    for (chunk, group), block_vals in zip(blocks, vals, strict=True):
        rows = [payloads[0].tensors[name].idx.shape[0] for name in group]
        idx_CU, val_CU = _merge_rows([torch.cat([p.tensors[name].idx for name in group]) for p in payloads],
                                     block_vals, count_zeros=count_zeros, topk=topk, n=chunk[0] * chunk[1],
                                     weights=weights)
        if rounding is not None:
            val_CU = rounding(val_CU)
        for name, idx_part, val_part in zip(group, torch.split(idx_CU, rows), torch.split(val_CU, rows),
                                            strict=True):
            merged[name] = Compressed(idx=idx_part, val=val_part, shape=payloads[0].tensors[name].shape, chunk=chunk)
    # Means of encoded values are no longer on the encoding's grid: the aggregate is plain floats.
    return Payload(tensors={name: merged[name] for name in names}, encoding="fp32"), factors
