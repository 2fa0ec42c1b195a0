"""Softmax attention with per-head sink logits (seed 004, section 1).

A sink logit ``s_h`` adds ``exp(s_h)`` to the softmax denominator of head ``h`` and nothing
to the numerator: real-token weights become ``a_j = exp(z_j) / (exp(s_h) + Z)``. Equivalently
the sink is a virtual key whose logit is ``s_h`` and whose value is the zero vector, or a gate
``out = sigmoid(logsumexp(z) - s_h) * out_dense``.

Two implementations, same contract:

* :func:`eager_sink_attention` -- the readable fp32 reference (explicit logits).
* :func:`sdpa_sink_attention` -- ``torch.nn.functional.scaled_dot_product_attention`` with the
  sink realised as a virtual zero-value key: one extra head dimension carries ``s_h`` so the
  fused kernel computes exactly the sink softmax.

Shapes at the boundary (transformers' attention-interface layout):
    query [B, HQ, T, D], key/value [B, H, S, D] with HQ % H == 0 (head r reads KV head r // (HQ/H)),
    mask: None (causal, bottom-right aligned), bool [B|1, 1, T, S] (True = may attend) or an additive
    float mask of the same shape; sinks [HQ] or None.
Output [B, T, HQ, D] (like transformers' attention functions). Query rows that may attend to no key
return zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def allowed_mask(attention_mask: torch.Tensor | None, q_len: int, kv_len: int, device) -> torch.Tensor:
    """Boolean [B|1, 1, T, S] mask (True = may attend) from any transformers mask format.

    ``None`` means plain causal attention with the queries being the last ``q_len`` positions.
    """
    if attention_mask is None:
        q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
        k_pos = torch.arange(kv_len, device=device)[None, :]
        return (k_pos <= q_pos)[None, None]
    if attention_mask.dtype == torch.bool:
        mask = attention_mask
    else:
        # transformers' eager masks are additive: 0 where allowed, dtype-min where masked.
        mask = attention_mask > torch.finfo(attention_mask.dtype).min / 2
    return mask[..., :kv_len]


def expand_kv(x: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """[B, H, S, D] -> [B, HQ, S, D], head r of the result is KV head r // (HQ/H)."""
    groups = num_q_heads // x.shape[1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def eager_sink_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
    training: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention with optional sinks, computed in fp32 (fp64 inputs stay fp64).

    Returns ``(out [B, T, HQ, D], weights [B, HQ, T, S])`` where weights are the real-token
    weights (they sum to ``Z / (Z + exp(s))`` per row when sinks are present).
    """
    b, hq, t, _ = query.shape
    s = key.shape[2]
    dtype = torch.promote_types(query.dtype, torch.float32)  # fp32 at least; fp64 stays fp64
    k = expand_kv(key, hq).to(dtype)
    v = expand_kv(value, hq).to(dtype)
    logits = torch.matmul(query.to(dtype), k.transpose(-1, -2)) * scaling  # [B, HQ, T, S]
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    allowed = allowed_mask(attention_mask, t, s, query.device)
    logits = logits.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink_col = sinks.to(dtype).view(1, hq, 1, 1).expand(b, hq, t, 1)
        logits = torch.cat([logits, sink_col], dim=-1)  # the sink is one more softmax slot
    row_max = logits.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))  # empty rows
    exp = torch.exp(logits - row_max)
    denom = exp.sum(dim=-1, keepdim=True)
    weights = exp / torch.where(denom > 0, denom, torch.ones_like(denom))
    if sinks is not None:
        weights = weights[..., :-1]  # the sink's value is zero: drop its column
    if dropout > 0.0 and training:
        weights = F.dropout(weights, p=dropout, training=True)
    out = torch.matmul(weights, v)  # [B, HQ, T, D]
    return out.transpose(1, 2).contiguous().to(query.dtype), weights.to(query.dtype)


def sdpa_sink_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float,
    sinks: torch.Tensor | None = None,
    dropout: float = 0.0,
    training: bool = False,
) -> tuple[torch.Tensor, None]:
    """Fused SDPA attention honouring sinks; returns ``(out [B, T, HQ, D], None)``.

    The sink is appended as a virtual key: every query gains a constant coordinate 1, every
    real key a 0 and the virtual key ``s_h / scaling`` there (zeros elsewhere), so its logit is
    exactly ``s_h``; its value is zero. Only rows' masks need one more always-allowed column.
    """
    b, hq, t, d = query.shape
    s = key.shape[2]
    k = expand_kv(key, hq)
    v = expand_kv(value, hq)
    if sinks is None:
        mask = None if attention_mask is None else allowed_mask(attention_mask, t, s, query.device)
        out = F.scaled_dot_product_attention(
            query, k, v, attn_mask=mask, dropout_p=dropout if training else 0.0,
            is_causal=mask is None and t > 1, scale=scaling,
        )
    else:
        ones = query.new_ones(b, hq, t, 1)
        q_ext = torch.cat([query, ones], dim=-1)  # [B, HQ, T, D+1]
        sink_coord = (sinks.to(key.dtype) / scaling).view(1, hq, 1, 1).expand(b, hq, 1, 1)
        sink_key = torch.cat([key.new_zeros(b, hq, 1, d), sink_coord], dim=-1)  # [B, HQ, 1, D+1]
        k_ext = torch.cat([torch.cat([k, k.new_zeros(b, hq, s, 1)], dim=-1), sink_key], dim=2)  # [B, HQ, S+1, D+1]
        v_ext = torch.cat([v, v.new_zeros(b, hq, 1, v.shape[-1])], dim=2)  # [B, HQ, S+1, Dv]
        allowed = allowed_mask(attention_mask, t, s, query.device)
        allowed = torch.cat([allowed.expand(allowed.shape[0], 1, t, s), allowed.new_ones(allowed.shape[0], 1, t, 1)], dim=-1)
        out = F.scaled_dot_product_attention(
            q_ext, k_ext, v_ext, attn_mask=allowed, dropout_p=dropout if training else 0.0, scale=scaling
        )
    if attention_mask is not None:
        # SDPA returns a uniform mix (or NaN) for rows with no allowed key; the contract is zeros.
        empty = ~allowed_mask(attention_mask, t, s, query.device).any(dim=-1, keepdim=True)  # [B|1, 1, T, 1]
        out = out.masked_fill(empty, 0.0)
    return out.transpose(1, 2).contiguous(), None


__all__ = ["allowed_mask", "eager_sink_attention", "expand_kv", "sdpa_sink_attention"]
