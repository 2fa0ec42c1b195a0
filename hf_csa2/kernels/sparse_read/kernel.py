"""Triton forward and backward kernels of ONE segment of a sparse read (imports Triton).

One program per (batch row, query, head block). A head block is ``HEADS`` consecutive heads
that read the same key group AND the same value group (``HEADS = gcd(H / G, H / G')``), so
its logits are one small matmul ``q [HEADS, Dk] @ k[N, Dk]^T`` per block of indexed entries.
Every tile is padded to at least 16 (``tl.dot``'s minimum) and masked.

All arithmetic is fp32 (inputs are upcast on load, ``tl.dot`` runs in full IEEE precision):
this kernel gathers a few entries per query, so it is bound by memory, not by matmul speed,
and the upcast also sidesteps the interpreter's broken bf16 ``tl.dot``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def _gather_entries(
    idx_ptr, k_ptr, v_ptr, b, t, n0, key_group, value_group, dk, dv,
    stride_ib, stride_it, stride_in, stride_kb, stride_ks, stride_kg, stride_kd,
    stride_vb, stride_vs, stride_vg, stride_vd, S, N, DK, DV, BLOCK_N: tl.constexpr,
):
    """Entries n0 .. n0 + BLOCK_N of query (b, t)'s index list: (valid mask, store rows, keys
    [BLOCK_N, BLOCK_DK], values [BLOCK_N, BLOCK_DV]) in fp32, zeros where invalid."""
    n = n0 + tl.arange(0, BLOCK_N)
    j = tl.load(idx_ptr + b * stride_ib + t * stride_it + n * stride_in, mask=n < N, other=-1)
    # an index outside [0, S) reads nothing (the reference raises; a kernel must not fault)
    ok = (j >= 0) & (j < S)
    row = tl.where(ok, j, 0)
    k = tl.load(k_ptr + b * stride_kb + row[:, None] * stride_ks + key_group * stride_kg + dk[None, :] * stride_kd,
                mask=ok[:, None] & (dk < DK)[None, :], other=0.0).to(tl.float32)
    v = tl.load(v_ptr + b * stride_vb + row[:, None] * stride_vs + value_group * stride_vg + dv[None, :] * stride_vd,
                mask=ok[:, None] & (dv < DV)[None, :], other=0.0).to(tl.float32)
    return ok, row, k, v


@triton.jit
def _sparse_read_fwd(
    q_ptr, k_ptr, v_ptr, idx_ptr, o_ptr, lse_ptr,
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kg, stride_kd,
    stride_vb, stride_vs, stride_vg, stride_vd,
    stride_ib, stride_it, stride_in,
    stride_ob, stride_ot, stride_oh, stride_od,
    stride_lb, stride_lt, stride_lh,
    T, S, N, DK, DV, scaling,
    HEADS: tl.constexpr, KEY_SHARE: tl.constexpr, VALUE_SHARE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    # int64 offsets: B * T * H * D may exceed 2^31 elements
    pid_bt = tl.program_id(0).to(tl.int64)
    h0 = tl.program_id(1).to(tl.int64) * HEADS
    b = pid_bt // T
    t = pid_bt % T
    key_group = h0 // KEY_SHARE
    value_group = h0 // VALUE_SHARE

    heads = h0 + tl.arange(0, BLOCK_H)
    head_ok = tl.arange(0, BLOCK_H) < HEADS
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + b * stride_qb + t * stride_qt + heads[:, None] * stride_qh + dk[None, :] * stride_qd,
                mask=head_ok[:, None] & (dk < DK)[None, :], other=0.0).to(tl.float32)

    # online softmax: running max m, running denominator l, unnormalised read-out acc
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for n0 in range(0, N, BLOCK_N):
        ok, row, k, v = _gather_entries(
            idx_ptr, k_ptr, v_ptr, b, t, n0, key_group, value_group, dk, dv,
            stride_ib, stride_it, stride_in, stride_kb, stride_ks, stride_kg, stride_kd,
            stride_vb, stride_vs, stride_vg, stride_vd, S, N, DK, DV, BLOCK_N)

        z = tl.dot(q, tl.trans(k), input_precision="ieee") * scaling
        z = tl.where(ok[None, :], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, 1))
        # while a row has seen no entry its max is -inf; shifting by 0 keeps exp(-inf - -inf) out
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - shift)
        p = tl.exp(z - shift[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m = m_new

    seen = l > 0
    l_safe = tl.where(seen, l, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(seen, m + tl.log(l_safe), float("-inf"))
    tl.store(o_ptr + b * stride_ob + t * stride_ot + heads[:, None] * stride_oh + dv[None, :] * stride_od, o,
             mask=head_ok[:, None] & (dv < DV)[None, :])
    tl.store(lse_ptr + b * stride_lb + t * stride_lt + heads * stride_lh, lse, mask=head_ok)


@triton.jit
def _sparse_read_bwd(
    q_ptr, k_ptr, v_ptr, idx_ptr, o_ptr, lse_ptr, do_ptr, dlse_ptr, dq_ptr, dk_ptr, dv_ptr,
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kg, stride_kd,
    stride_vb, stride_vs, stride_vg, stride_vd,
    stride_ib, stride_it, stride_in,
    stride_ob, stride_ot, stride_oh, stride_od,
    stride_lb, stride_lt, stride_lh,
    stride_dqb, stride_dqt, stride_dqh, stride_dqd,
    stride_dkb, stride_dks, stride_dkg, stride_dkd,
    stride_dvb, stride_dvs, stride_dvg, stride_dvd,
    T, S, N, DK, DV, scaling,
    HEADS: tl.constexpr, KEY_SHARE: tl.constexpr, VALUE_SHARE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    # do shares o's strides and dlse shares lse's (the launcher makes all four contiguous)
    pid_bt = tl.program_id(0).to(tl.int64)
    h0 = tl.program_id(1).to(tl.int64) * HEADS
    b = pid_bt // T
    t = pid_bt % T
    key_group = h0 // KEY_SHARE
    value_group = h0 // VALUE_SHARE

    heads = h0 + tl.arange(0, BLOCK_H)
    head_ok = tl.arange(0, BLOCK_H) < HEADS
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    q_mask = head_ok[:, None] & (dk < DK)[None, :]
    o_mask = head_ok[:, None] & (dv < DV)[None, :]
    q = tl.load(q_ptr + b * stride_qb + t * stride_qt + heads[:, None] * stride_qh + dk[None, :] * stride_qd,
                mask=q_mask, other=0.0).to(tl.float32)
    o_offs = b * stride_ob + t * stride_ot + heads[:, None] * stride_oh + dv[None, :] * stride_od
    o = tl.load(o_ptr + o_offs, mask=o_mask, other=0.0)
    do = tl.load(do_ptr + o_offs, mask=o_mask, other=0.0)
    l_offs = b * stride_lb + t * stride_lt + heads * stride_lh
    lse = tl.load(lse_ptr + l_offs, mask=head_ok, other=float("-inf"))
    dlse = tl.load(dlse_ptr + l_offs, mask=head_ok, other=0.0)
    # rows that read nothing have lse = -inf and every p_j = 0
    shift = tl.where(lse == float("-inf"), 0.0, lse)
    delta = tl.sum(do * o, 1)  # dO . o

    dq = tl.zeros([BLOCK_H, BLOCK_DK], tl.float32)
    for n0 in range(0, N, BLOCK_N):
        ok, row, k, v = _gather_entries(
            idx_ptr, k_ptr, v_ptr, b, t, n0, key_group, value_group, dk, dv,
            stride_ib, stride_it, stride_in, stride_kb, stride_ks, stride_kg, stride_kd,
            stride_vb, stride_vs, stride_vg, stride_vd, S, N, DK, DV, BLOCK_N)

        z = tl.dot(q, tl.trans(k), input_precision="ieee") * scaling
        z = tl.where(ok[None, :] & head_ok[:, None], z, float("-inf"))
        p = tl.exp(z - shift[:, None])  # the segment-normalised weights
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")  # dO . v_j
        dz = p * (dp - delta[:, None] + dlse[:, None])
        dq += tl.dot(dz, k, input_precision="ieee")

        # several queries (and repeated entries of one list) hit the same store row: atomics
        d_keys = tl.dot(tl.trans(dz), q, input_precision="ieee") * scaling  # [BLOCK_N, BLOCK_DK]
        d_values = tl.dot(tl.trans(p), do, input_precision="ieee")  # [BLOCK_N, BLOCK_DV]
        tl.atomic_add(dk_ptr + b * stride_dkb + row[:, None] * stride_dks + key_group * stride_dkg + dk[None, :] * stride_dkd,
                      d_keys, mask=ok[:, None] & (dk < DK)[None, :])
        tl.atomic_add(dv_ptr + b * stride_dvb + row[:, None] * stride_dvs + value_group * stride_dvg + dv[None, :] * stride_dvd,
                      d_values, mask=ok[:, None] & (dv < DV)[None, :])

    tl.store(dq_ptr + b * stride_dqb + t * stride_dqt + heads[:, None] * stride_dqh + dk[None, :] * stride_dqd,
             dq * scaling, mask=q_mask)


INTERPRETED = isinstance(_sparse_read_fwd, InterpretedFunction)
"""Whether these kernels run in Triton's CPU interpreter (fixed when this module was imported)."""

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _tile(width: int) -> int:
    return max(16, triton.next_power_of_2(width))


def _layout(query, keys, values, index, block_n):
    b, t, h, d_k = query.shape
    g, g_v, d_v = keys.shape[2], values.shape[2], values.shape[3]
    heads = math.gcd(h // g, h // g_v)
    n = index.shape[2]
    block_n = _tile(min(n, 64)) if block_n is None else _tile(block_n)
    consts = dict(HEADS=heads, KEY_SHARE=h // g, VALUE_SHARE=h // g_v, BLOCK_H=_tile(heads), BLOCK_N=block_n,
                  BLOCK_DK=_tile(d_k), BLOCK_DV=_tile(d_v))
    grid = (b * t, h // heads)
    return grid, consts, (t, keys.shape[1], n, d_k, d_v)


def sparse_read_forward(query, keys, values, index, scaling: float, block_n: int | None = None):
    """One segment's normalised read and log-sum-exp.

    query [B, T, H, Dk], keys [B, S, G, Dk], values [B, S, G', Dv], index [B, T, N] (-1 = none)
    -> o [B, T, H, Dv] fp32 (zeros where the row has no entry), lse [B, T, H] fp32 (-inf there).
    ``block_n``: entries per loop step (rounded up to a power of two >= 16; default min(N, 64)).
    """
    b, t, h, _ = query.shape
    grid, consts, sizes = _layout(query, keys, values, index, block_n)
    o = query.new_empty(b, t, h, values.shape[3], dtype=torch.float32)
    lse = query.new_empty(b, t, h, dtype=torch.float32)
    if o.numel() or lse.numel():
        _sparse_read_fwd[grid](
            query, keys, values, index, o, lse,
            *query.stride(), *keys.stride(), *values.stride(), *index.stride(), *o.stride(), *lse.stride(),
            *sizes, float(scaling), **consts)
    return o, lse


def sparse_read_backward(query, keys, values, index, o, lse, d_o, d_lse, scaling: float, block_n: int | None = None):
    """Gradients of one segment's read from those of its outputs ``o`` and ``lse`` (shapes as in
    :func:`sparse_read_forward`) -> (d_query, d_keys, d_values) in the inputs' dtypes.

    d_keys / d_values are accumulated in fp32 buffers with atomics (entries shared by several
    queries), then cast.
    """
    grid, consts, sizes = _layout(query, keys, values, index, block_n)
    d_o = d_o.to(torch.float32).contiguous()
    d_lse = d_lse.to(torch.float32).contiguous()
    o, lse = o.contiguous(), lse.contiguous()  # d_o and o share strides in the kernel; so do lse and d_lse
    d_query = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    d_keys = torch.zeros(keys.shape, dtype=torch.float32, device=keys.device)
    d_values = torch.zeros(values.shape, dtype=torch.float32, device=values.device)
    if d_query.numel():
        _sparse_read_bwd[grid](
            query, keys, values, index, o, lse, d_o, d_lse, d_query, d_keys, d_values,
            *query.stride(), *keys.stride(), *values.stride(), *index.stride(), *o.stride(), *lse.stride(),
            *d_query.stride(), *d_keys.stride(), *d_values.stride(),
            *sizes, float(scaling), **consts)
    return d_query.to(query.dtype), d_keys.to(keys.dtype), d_values.to(values.dtype)


__all__ = ["INTERPRETED", "SUPPORTED_DTYPES", "sparse_read_backward", "sparse_read_forward"]
