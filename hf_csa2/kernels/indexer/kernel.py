"""Triton kernels of the indexer's masked scores (imports Triton).

    score[b, t, j] = sum_n w[b, t, n] * ReLU(q[b, t, n] . k[b, j])   where j is selectable, else -inf

Forward: one program per (query block, key block, batch row) sums the index heads' ReLU'd
``tl.dot`` tiles into one [BLOCK_T, BLOCK_S] accumulator, so the per-head dots [T, n_I, S]
the torch reference materialises never exist. A tile wholly outside every query's selectable
range (the causal future and the window) is written as -inf without a dot.

Top-K (``_top_k_fwd``): one program per (query block, batch row) scores key blocks of K_PAD
(K rounded up to a power of two) with the same tile code and keeps, per query, the K_PAD best
int64 selection keys -- the score's order-preserving bits high, ``S - 1 - j`` low, as
``top_k_earliest_first`` builds them -- with a bitonic network (the block sorted, its
elementwise max with the best so far, one merge). All keys differ, so the picks and their order are those of the reference's sort
of the same scores, ties to the earlier position.

Backward, without atomics (FLA style: one kernel per gradient owner, dots recomputed):
``_scores_bwd_query`` -- one program per (query block, head, row) loops over key blocks for
dq and dw; ``_scores_bwd_key`` -- one program per (key block, row) loops over query blocks
and heads for dk. With ``g`` the incoming gradient (ignored where the score is -inf) and
``d = q . k``: ``dw_n = sum_j g * ReLU(d)``, ``dd = g * w_n * [d > 0]``, ``dq_n = sum_j dd k_j``,
``dk_j = sum_{t, n} dd q_{t, n}``.

All arithmetic is fp32 (inputs upcast on load; ``tl.dot`` in IEEE precision: the selection
compares scores, and the interpreter's bf16 ``tl.dot`` is broken).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def _selectable(pos_ptr, starts_ptr, b, t, j, T, S, window, HAS_STARTS: tl.constexpr):
    """(mask [BLOCK_T, BLOCK_S] of pairs query t may pick key j at, in-bounds mask)."""
    pos = tl.load(pos_ptr + t, mask=t < T, other=0)
    inside = (t < T)[:, None] & (j < S)[None, :]
    ok = inside & (j[None, :] <= pos[:, None] - window)
    if HAS_STARTS:
        first = tl.load(starts_ptr + b)
        ok = ok & (j[None, :] >= first)
    return ok, inside


@triton.jit
def _score_tile(
    q_ptr, w_ptr, k_ptr, b, t, j, d,
    stride_qb, stride_qt, stride_qn, stride_qd,
    stride_wb, stride_wt, stride_wn,
    stride_kb, stride_ks, stride_kd,
    T, S, D, NUM_HEADS: tl.constexpr,
):
    """``sum_n w_n * ReLU(q_n . k_j)`` [BLOCK_T, BLOCK_S] fp32 for queries ``t`` and keys ``j``
    (unmasked: the caller applies the selectable mask)."""
    k = tl.load(k_ptr + b * stride_kb + j[:, None] * stride_ks + d[None, :] * stride_kd,
                mask=(j < S)[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)
    acc = tl.zeros([t.shape[0], j.shape[0]], tl.float32)
    for n in range(NUM_HEADS):
        q = tl.load(q_ptr + b * stride_qb + t[:, None] * stride_qt + n * stride_qn + d[None, :] * stride_qd,
                    mask=(t < T)[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptr + b * stride_wb + t * stride_wt + n * stride_wn, mask=t < T, other=0.0).to(tl.float32)
        dots = tl.dot(q, tl.trans(k), input_precision="ieee")
        acc += w[:, None] * tl.maximum(dots, 0.0)
    return acc


@triton.jit
def _scores_fwd(
    q_ptr, w_ptr, k_ptr, pos_ptr, starts_ptr, out_ptr,
    stride_qb, stride_qt, stride_qn, stride_qd,
    stride_wb, stride_wt, stride_wn,
    stride_kb, stride_ks, stride_kd,
    stride_ob, stride_ot, stride_os,
    T, S, D, window,
    NUM_HEADS: tl.constexpr, HAS_STARTS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t0 = tl.program_id(0) * BLOCK_T
    j0 = tl.program_id(1) * BLOCK_S
    b = tl.program_id(2).to(tl.int64)  # int64 offsets: B * T * S may exceed 2^31
    t = t0 + tl.arange(0, BLOCK_T)
    j = j0 + tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    ok, inside = _selectable(pos_ptr, starts_ptr, b, t, j, T, S, window, HAS_STARTS)
    acc = tl.zeros([BLOCK_T, BLOCK_S], tl.float32)
    newest = tl.max(tl.load(pos_ptr + t, mask=t < T, other=-1)) - window  # newest key any query here may pick
    if j0 <= newest:
        acc = _score_tile(q_ptr, w_ptr, k_ptr, b, t, j, d,
                          stride_qb, stride_qt, stride_qn, stride_qd, stride_wb, stride_wt, stride_wn,
                          stride_kb, stride_ks, stride_kd, T, S, D, NUM_HEADS)
    scores = tl.where(ok, acc, float("-inf"))
    tl.store(out_ptr + b * stride_ob + t[:, None] * stride_ot + j[None, :] * stride_os, scores, mask=inside)


# The order-preserving int32 image of -inf's bits (0xFF800000): a selection key whose high half
# is this was never selectable (-inf score, or past the end of the keys).
_NEG_INF_ORDERED = -0x7F800000 - 1


@triton.jit
def _compare_swap(x, STRIDE: tl.constexpr, SIZE: tl.constexpr, DESCENDING: tl.constexpr,
                  ROWS: tl.constexpr, N: tl.constexpr):
    """One bitonic step on each row of x [ROWS, N]: elements STRIDE apart are ordered, runs of
    SIZE alternately descending and ascending (all one way when SIZE == N). Split/join, not the
    reductions of tl.sort: those run element by element in the interpreter."""
    groups: tl.constexpr = N // (2 * STRIDE)
    a, b = tl.split(tl.permute(tl.reshape(x, [ROWS, groups, 2, STRIDE]), [0, 1, 3, 2]))
    g = tl.arange(0, groups)
    down = ((g * 2 * STRIDE) // SIZE) % 2 == (0 if DESCENDING else 1)
    down = down[None, :, None]
    high = tl.maximum(a, b)
    low = tl.minimum(a, b)
    y = tl.join(tl.where(down, high, low), tl.where(down, low, high))
    return tl.reshape(tl.permute(y, [0, 1, 3, 2]), [ROWS, N])


@triton.jit
def _bitonic_sort(x, ROWS: tl.constexpr, LOG_N: tl.constexpr, DESCENDING: tl.constexpr):
    """Each row of x [ROWS, 2^LOG_N] sorted."""
    for stage in tl.static_range(1, LOG_N + 1):
        for step in tl.static_range(stage):
            x = _compare_swap(x, 1 << (stage - 1 - step), 1 << stage, DESCENDING, ROWS, 1 << LOG_N)
    return x


@triton.jit
def _bitonic_merge_descending(x, ROWS: tl.constexpr, LOG_N: tl.constexpr):
    """Each bitonic row of x [ROWS, 2^LOG_N] sorted descending."""
    for step in tl.static_range(LOG_N):
        x = _compare_swap(x, 1 << (LOG_N - 1 - step), 1 << LOG_N, True, ROWS, 1 << LOG_N)
    return x


@triton.jit
def _top_k_fwd(
    q_ptr, w_ptr, k_ptr, pos_ptr, starts_ptr, out_ptr,
    stride_qb, stride_qt, stride_qn, stride_qd,
    stride_wb, stride_wt, stride_wn,
    stride_kb, stride_ks, stride_kd,
    stride_ob, stride_ot, stride_ok,
    T, S, D, window, TOP_K,
    NUM_HEADS: tl.constexpr, HAS_STARTS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, LOG_K: tl.constexpr,
):
    """One program per (query block, batch row) streams over key blocks of K_PAD, keeping each
    query's K_PAD = 2^LOG_K best selection keys, sorted descending; the [T, S] scores never reach
    memory. Per block: the block's keys sorted ascending, the elementwise max with the best so far
    (the K_PAD largest of both, a bitonic row), one bitonic merge."""
    K_PAD: tl.constexpr = 1 << LOG_K
    t0 = tl.program_id(0) * BLOCK_T
    b = tl.program_id(1).to(tl.int64)
    t = t0 + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    # keys as top_k_earliest_first builds them: the score's ordered bits high, S - 1 - j low
    nothing = tl.full([BLOCK_T, K_PAD], _NEG_INF_ORDERED, tl.int64) << 32
    best = nothing
    newest = tl.max(tl.load(pos_ptr + t, mask=t < T, other=-1)) - window
    for j0 in range(0, S, K_PAD):
        if j0 <= newest:
            j = j0 + tl.arange(0, K_PAD)
            ok, inside = _selectable(pos_ptr, starts_ptr, b, t, j, T, S, window, HAS_STARTS)
            acc = _score_tile(q_ptr, w_ptr, k_ptr, b, t, j, d,
                              stride_qb, stride_qt, stride_qn, stride_qd, stride_wb, stride_wt, stride_wn,
                              stride_kb, stride_ks, stride_kd, T, S, D, NUM_HEADS)
            scores = tl.where(ok, acc, float("-inf")) + 0.0  # + 0.0: -0.0 sorts as +0.0
            bits = scores.to(tl.int32, bitcast=True).to(tl.int64)
            ordered = tl.where(bits >= 0, bits, -(bits & 0x7FFFFFFF) - 1)
            keys = (ordered << 32) | (S - 1 - j).to(tl.int64)[None, :]
            keys = tl.where((j < S)[None, :], keys, nothing)
            keys = _bitonic_sort(keys, BLOCK_T, LOG_K, False)
            best = _bitonic_merge_descending(tl.maximum(best, keys), BLOCK_T, LOG_K)
    picked = tl.where((best >> 32) == _NEG_INF_ORDERED, -1, S - 1 - (best & 0xFFFFFFFF))
    c = tl.arange(0, K_PAD)
    tl.store(out_ptr + b * stride_ob + t[:, None] * stride_ot + c[None, :] * stride_ok, picked,
             mask=(t < T)[:, None] & (c < TOP_K)[None, :])


@triton.jit
def _scores_bwd_query(
    q_ptr, w_ptr, k_ptr, pos_ptr, starts_ptr, g_ptr, dq_ptr, dw_ptr,
    stride_qb, stride_qt, stride_qn, stride_qd,
    stride_wb, stride_wt, stride_wn,
    stride_kb, stride_ks, stride_kd,
    stride_gb, stride_gt, stride_gs,
    stride_dqb, stride_dqt, stride_dqn, stride_dqd,
    stride_dwb, stride_dwt, stride_dwn,
    T, S, D, window,
    HAS_STARTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t0 = tl.program_id(0) * BLOCK_T
    n = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    t = t0 + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    q_mask = (t < T)[:, None] & (d < D)[None, :]
    q = tl.load(q_ptr + b * stride_qb + t[:, None] * stride_qt + n * stride_qn + d[None, :] * stride_qd,
                mask=q_mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + b * stride_wb + t * stride_wt + n * stride_wn, mask=t < T, other=0.0).to(tl.float32)
    dq = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    dw = tl.zeros([BLOCK_T], tl.float32)
    newest = tl.max(tl.load(pos_ptr + t, mask=t < T, other=-1)) - window
    for j0 in range(0, S, BLOCK_S):
        if j0 <= newest:
            j = j0 + tl.arange(0, BLOCK_S)
            ok, _ = _selectable(pos_ptr, starts_ptr, b, t, j, T, S, window, HAS_STARTS)
            k = tl.load(k_ptr + b * stride_kb + j[:, None] * stride_ks + d[None, :] * stride_kd,
                        mask=(j < S)[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)
            g = tl.load(g_ptr + b * stride_gb + t[:, None] * stride_gt + j[None, :] * stride_gs, mask=ok, other=0.0)
            dots = tl.dot(q, tl.trans(k), input_precision="ieee")
            dw += tl.sum(g * tl.maximum(dots, 0.0), axis=1)
            d_dots = tl.where(dots > 0, g * w[:, None], 0.0)
            dq += tl.dot(d_dots, k, input_precision="ieee")
    tl.store(dq_ptr + b * stride_dqb + t[:, None] * stride_dqt + n * stride_dqn + d[None, :] * stride_dqd, dq,
             mask=q_mask)
    tl.store(dw_ptr + b * stride_dwb + t * stride_dwt + n * stride_dwn, dw, mask=t < T)


@triton.jit
def _scores_bwd_key(
    q_ptr, w_ptr, k_ptr, pos_ptr, starts_ptr, g_ptr, dk_ptr,
    stride_qb, stride_qt, stride_qn, stride_qd,
    stride_wb, stride_wt, stride_wn,
    stride_kb, stride_ks, stride_kd,
    stride_gb, stride_gt, stride_gs,
    stride_dkb, stride_dks, stride_dkd,
    T, S, D, window,
    NUM_HEADS: tl.constexpr, HAS_STARTS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    j0 = tl.program_id(0) * BLOCK_S
    b = tl.program_id(1).to(tl.int64)
    j = j0 + tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    k_mask = (j < S)[:, None] & (d < D)[None, :]
    k = tl.load(k_ptr + b * stride_kb + j[:, None] * stride_ks + d[None, :] * stride_kd,
                mask=k_mask, other=0.0).to(tl.float32)
    dk = tl.zeros([BLOCK_S, BLOCK_D], tl.float32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        newest = tl.max(tl.load(pos_ptr + t, mask=t < T, other=-1)) - window
        if j0 <= newest:
            ok, _ = _selectable(pos_ptr, starts_ptr, b, t, j, T, S, window, HAS_STARTS)
            g = tl.load(g_ptr + b * stride_gb + t[:, None] * stride_gt + j[None, :] * stride_gs, mask=ok, other=0.0)
            for n in range(NUM_HEADS):
                q = tl.load(q_ptr + b * stride_qb + t[:, None] * stride_qt + n * stride_qn + d[None, :] * stride_qd,
                            mask=(t < T)[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)
                w = tl.load(w_ptr + b * stride_wb + t * stride_wt + n * stride_wn, mask=t < T,
                            other=0.0).to(tl.float32)
                dots = tl.dot(q, tl.trans(k), input_precision="ieee")
                d_dots = tl.where(dots > 0, g * w[:, None], 0.0)
                dk += tl.dot(tl.trans(d_dots), q, input_precision="ieee")
    tl.store(dk_ptr + b * stride_dkb + j[:, None] * stride_dks + d[None, :] * stride_dkd, dk, mask=k_mask)


INTERPRETED = isinstance(_scores_fwd, InterpretedFunction)
"""Whether these kernels run in Triton's CPU interpreter (fixed when this module was imported)."""

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _tile(width: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(max(width, 1))))


def _blocks(t: int, s: int, d: int) -> dict:
    return dict(BLOCK_T=_tile(t, 32), BLOCK_S=_tile(s, 64), BLOCK_D=max(16, triton.next_power_of_2(d)))


def _starts_arg(starts, device):
    # a dummy pointer when there are no starts (HAS_STARTS=False never reads it)
    return (starts.to(device=device, dtype=torch.int64).contiguous(), True) if starts is not None else (
        torch.zeros(1, dtype=torch.int64, device=device), False)


def masked_scores_forward(queries, weights, keys, query_positions, window: int, starts=None):
    """queries [B, T, n_I, d_I], weights [B, T, n_I], keys [B, S, d_I], query_positions [T]
    long, starts [B] long or None -> scores [B, T, S] fp32, -inf where not selectable."""
    b, t, n_heads, d = queries.shape
    s = keys.shape[1]
    out = torch.empty((b, t, s), dtype=torch.float32, device=queries.device)
    if out.numel() == 0:
        return out
    positions = query_positions.to(device=queries.device, dtype=torch.int64).contiguous()
    starts_t, has_starts = _starts_arg(starts, queries.device)
    blocks = _blocks(t, s, d)
    grid = (triton.cdiv(t, blocks["BLOCK_T"]), triton.cdiv(s, blocks["BLOCK_S"]), b)
    _scores_fwd[grid](
        queries, weights, keys, positions, starts_t, out,
        *queries.stride(), *weights.stride(), *keys.stride(), *out.stride(),
        t, s, d, int(window), NUM_HEADS=n_heads, HAS_STARTS=has_starts, **blocks)
    return out


def top_k_forward(queries, weights, keys, query_positions, top_k: int, window: int, starts=None):
    """The picks of :func:`hf_csa2.model.indexer.select_top_k` on the kernel's scores, without
    them in memory: queries [B, T, n_I, d_I], weights [B, T, n_I], keys [B, S, d_I],
    query_positions [T] long, starts [B] long or None -> positions [B, T, top_k] long, best
    first, ties to the earlier position, -1 where fewer are selectable."""
    b, t, n_heads, d = queries.shape
    s = keys.shape[1]
    out = torch.full((b, t, top_k), -1, dtype=torch.long, device=queries.device)
    if out.numel() == 0 or s == 0:
        return out
    positions = query_positions.to(device=queries.device, dtype=torch.int64).contiguous()
    starts_t, has_starts = _starts_arg(starts, queries.device)
    block_t = 16  # tl.dot's smallest tile; two [16, K_PAD] int64 rows of keys per program
    _top_k_fwd[(triton.cdiv(t, block_t), b)](
        queries, weights, keys, positions, starts_t, out,
        *queries.stride(), *weights.stride(), *keys.stride(), *out.stride(),
        t, s, d, int(window), int(top_k), NUM_HEADS=n_heads, HAS_STARTS=has_starts,
        BLOCK_T=block_t, BLOCK_D=max(16, triton.next_power_of_2(d)), LOG_K=_tile(top_k, 1 << 30).bit_length() - 1)
    return out


def masked_scores_backward(queries, weights, keys, query_positions, window: int, starts, grad):
    """Gradients (d_queries, d_weights, d_keys), in the inputs' dtypes, of the scores of
    :func:`masked_scores_forward` given ``grad`` [B, T, S] (ignored where a score is -inf)."""
    b, t, n_heads, d = queries.shape
    s = keys.shape[1]
    dq = torch.zeros(queries.shape, dtype=torch.float32, device=queries.device)
    dw = torch.zeros(weights.shape, dtype=torch.float32, device=queries.device)
    dk = torch.zeros(keys.shape, dtype=torch.float32, device=queries.device)
    if t and s and n_heads:
        grad = grad.to(torch.float32)
        positions = query_positions.to(device=queries.device, dtype=torch.int64).contiguous()
        starts_t, has_starts = _starts_arg(starts, queries.device)
        blocks = _blocks(t, s, d)
        common = (*queries.stride(), *weights.stride(), *keys.stride(), *grad.stride())
        _scores_bwd_query[(triton.cdiv(t, blocks["BLOCK_T"]), n_heads, b)](
            queries, weights, keys, positions, starts_t, grad, dq, dw,
            *common, *dq.stride(), *dw.stride(), t, s, d, int(window), HAS_STARTS=has_starts, **blocks)
        _scores_bwd_key[(triton.cdiv(s, blocks["BLOCK_S"]), b)](
            queries, weights, keys, positions, starts_t, grad, dk,
            *common, *dk.stride(), t, s, d, int(window), NUM_HEADS=n_heads, HAS_STARTS=has_starts, **blocks)
    return dq.to(queries.dtype), dw.to(weights.dtype), dk.to(keys.dtype)


__all__ = ["INTERPRETED", "SUPPORTED_DTYPES", "masked_scores_backward", "masked_scores_forward", "top_k_forward"]
