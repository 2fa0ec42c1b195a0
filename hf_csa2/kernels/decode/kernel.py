"""Triton kernels of one decode step with sinks (imports Triton).

    out[r] = sum_j exp(z_rj) v_j / (exp(s_r) + sum_j exp(z_rj)),   z_rj = scale * q_r . k_j

for the query heads ``r`` of each KV head (GQA / MQA; MLA's absorbed read, where every query
head reads the one latent, is MQA with keys ``[latent, 1, rope]`` and values ``[latent, 1]``).

Split-KV ("flash-decoding"): ``_decode_split`` -- one program per (key split, KV head, batch row)
holds the group's query heads as the rows of one ``tl.dot`` against each key block, so keys and
values are read once per KV head, never per query head, and keeps an online softmax (running max,
denominator, weighted values) over its split. ``_decode_combine`` -- one program per (query head,
batch row) merges the splits through their maxima and denominators, the sink joining the
denominator only. A split with no allowed key leaves max -inf and contributes nothing; a row with
none at all gives zeros. All arithmetic fp32 (inputs upcast on load).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def _decode_split(
    q_ptr, k_ptr, v_ptr, mask_ptr, o_ptr, m_ptr, l_ptr,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_mb, stride_ms,
    stride_ob, stride_oh, stride_oc, stride_od,
    stride_lb, stride_lh, stride_lc,
    S, DK, DV, scale, split_len,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    c = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    rows = h * GROUP + g
    row_ok = g < GROUP
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + b * stride_qb + rows[:, None] * stride_qh + dk[None, :] * stride_qd,
                mask=row_ok[:, None] & (dk < DK)[None, :], other=0.0).to(tl.float32)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    lo = c * split_len
    hi = tl.minimum(lo + split_len, S)
    for s0 in range(lo, hi, BLOCK_S):
        j = s0 + tl.arange(0, BLOCK_S)
        ok = j < hi
        if HAS_MASK:
            ok = ok & (tl.load(mask_ptr + b * stride_mb + j * stride_ms, mask=ok, other=0) != 0)
        k = tl.load(k_ptr + b * stride_kb + h * stride_kh + j[:, None] * stride_ks + dk[None, :] * stride_kd,
                    mask=ok[:, None] & (dk < DK)[None, :], other=0.0).to(tl.float32)
        z = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        z = tl.where(ok[None, :], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: exp(-inf - 0) = 0, never NaN
        p = tl.exp(z - shift[:, None])
        alpha = tl.exp(m - shift)
        den = den * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + b * stride_vb + h * stride_vh + j[:, None] * stride_vs + dv[None, :] * stride_vd,
                    mask=ok[:, None] & (dv < DV)[None, :], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m = m_new
    tl.store(o_ptr + b * stride_ob + rows[:, None] * stride_oh + c * stride_oc + dv[None, :] * stride_od, acc,
             mask=row_ok[:, None] & (dv < DV)[None, :])
    tl.store(m_ptr + b * stride_lb + rows * stride_lh + c * stride_lc, m, mask=row_ok)
    tl.store(l_ptr + b * stride_lb + rows * stride_lh + c * stride_lc, den, mask=row_ok)


@triton.jit
def _decode_combine(
    o_ptr, m_ptr, l_ptr, sink_ptr, out_ptr,
    stride_ob, stride_oh, stride_oc, stride_od,
    stride_lb, stride_lh, stride_lc,
    stride_yb, stride_yh, stride_yd,
    SPLITS, DV,
    HAS_SINKS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    dv = tl.arange(0, BLOCK_DV)
    c_ok = c < SPLITS
    m = tl.load(m_ptr + b * stride_lb + r * stride_lh + c * stride_lc, mask=c_ok, other=float("-inf"))
    den = tl.load(l_ptr + b * stride_lb + r * stride_lh + c * stride_lc, mask=c_ok, other=0.0)
    peak = tl.max(m, axis=0)
    if HAS_SINKS:
        sink = tl.load(sink_ptr + r).to(tl.float32)
        peak = tl.maximum(peak, sink)
    peak = tl.where(peak == float("-inf"), 0.0, peak)
    w = tl.exp(m - peak)  # 0 for a split without keys
    total = tl.sum(den * w, axis=0)
    if HAS_SINKS:
        total += tl.exp(sink - peak)
    o = tl.load(o_ptr + b * stride_ob + r * stride_oh + c[:, None] * stride_oc + dv[None, :] * stride_od,
                mask=c_ok[:, None] & (dv < DV)[None, :], other=0.0)
    y = tl.sum(o * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_yb + r * stride_yh + dv * stride_yd, y, mask=dv < DV)


INTERPRETED = isinstance(_decode_split, InterpretedFunction)
"""Whether these kernels run in Triton's CPU interpreter (fixed when this module was imported)."""

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def default_split_len(batch: int, kv_heads: int, keys: int, block_s: int) -> int:
    """Keys per split: enough splits that batch x KV heads x splits fills a GPU (about 256
    programs), each split a whole number of key blocks; one split in the interpreter (it pays
    per program, not per element)."""
    if INTERPRETED:
        return max(block_s, triton.cdiv(keys, block_s) * block_s)
    splits = max(1, min(triton.cdiv(keys, block_s), 256 // max(1, batch * kv_heads)))
    return triton.cdiv(triton.cdiv(keys, splits), block_s) * block_s


def decode_forward(query, key, value, allowed, scale: float, sinks=None, split_len: int | None = None):
    """query [B, HQ, Dk], key [B, H, S, Dk], value [B, H, S, Dv] (strides free, 0 allowed),
    allowed [B, S] int8 or None, sinks [HQ] or None -> out [B, HQ, Dv] fp32."""
    b, hq, dk = query.shape
    h, s = key.shape[1], key.shape[2]
    dv = value.shape[-1]
    out = torch.zeros((b, hq, dv), dtype=torch.float32, device=query.device)
    if out.numel() == 0 or s == 0:
        return out
    block_s = 64 if s >= 64 else 16
    split_len = split_len or default_split_len(b, h, s, block_s)
    splits = triton.cdiv(s, split_len)
    part = torch.empty((b, hq, splits, dv), dtype=torch.float32, device=query.device)
    peak = torch.empty((b, hq, splits), dtype=torch.float32, device=query.device)
    den = torch.empty_like(peak)
    mask = allowed if allowed is not None else torch.ones(1, 1, dtype=torch.int8, device=query.device)
    group = hq // h
    _decode_split[(splits, h, b)](
        query, key, value, mask, part, peak, den,
        *query.stride(), *key.stride(), *value.stride(), *mask.stride(), *part.stride(), *peak.stride(),
        s, dk, dv, float(scale), split_len,
        NUM_KV_HEADS=h, GROUP=group, HAS_MASK=allowed is not None,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_S=block_s,
        BLOCK_DK=max(16, triton.next_power_of_2(dk)), BLOCK_DV=max(16, triton.next_power_of_2(dv)))
    sink_arg = sinks.contiguous() if sinks is not None else peak  # a dummy pointer without sinks
    _decode_combine[(hq, b)](
        part, peak, den, sink_arg, out,
        *part.stride(), *peak.stride(), *out.stride(), splits, dv,
        HAS_SINKS=sinks is not None, BLOCK_C=max(2, triton.next_power_of_2(splits)),
        BLOCK_DV=max(16, triton.next_power_of_2(dv)))
    return out


__all__ = ["INTERPRETED", "SUPPORTED_DTYPES", "decode_forward", "default_split_len"]
