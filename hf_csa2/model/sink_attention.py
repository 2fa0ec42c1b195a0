"""Softmax attention with per-head sink logits (seed 004, section 1).

A sink logit ``s_h`` adds ``exp(s_h)`` to the softmax denominator of head ``h`` and nothing
to the numerator: real-token weights become ``a_j = exp(z_j) / (exp(s_h) + Z)``. Equivalently
the sink is a virtual key whose logit is ``s_h`` and whose value is the zero vector, or a gate
``out = sigmoid(logsumexp(z) - s_h) * out_dense``.

Four implementations, same contract:

* :func:`eager_sink_attention` -- the readable reference (explicit logits, fp32 softmax).
* :func:`fla_sink_attention` -- fla-core's Triton ``parallel_attn`` (it takes a sink bias,
  forward and backward) for causal prefills and training windows; used on CUDA where fla-core
  is installed (``dense_attention_path``), never written again here.
* ``hf_csa2.kernels.decode`` -- hf_csa2's Triton kernel of :func:`grouped_decode_attention`
  (decode steps with a cache, which fla-core's kernel does not take); on CUDA where hf_csa2 is
  installed (``dense_attention_path``).
* :func:`sdpa_sink_attention` -- ``torch.nn.functional.scaled_dot_product_attention`` for the
  dense part, times the sink gate computed by a second fused call in which the sink is a
  virtual key (one extra head dimension carries ``s_h``); on CPU without gradients one fused
  call that also returns ``logsumexp(z)`` (the gate's other input), at about the cost of the
  call without sinks; for one query position without gradients (decode)
  :func:`grouped_decode_attention`, one matmul per KV head, keys never repeated per query head.

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


def masked_logits(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, *,
                  scaling: float, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled (soft-capped) logits [B, HQ, T, S] with masked entries at dtype-min, computed as
    transformers' eager path does (an additive float mask is added), and the bool mask of
    allowed entries [B|1, 1, T, S]."""
    t, s = query.shape[2], key.shape[2]
    logits = torch.matmul(query, expand_kv(key, query.shape[1]).transpose(-1, -2)) * scaling
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    allowed = allowed_mask(attention_mask, t, s, query.device)
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        logits = logits + attention_mask[..., :s]
    else:
        logits = logits.masked_fill(~allowed, torch.finfo(logits.dtype).min)
    return logits, allowed


def eager_sink_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                         *, scaling: float, sinks: torch.Tensor | None = None, softcap: float | None = None,
                         dropout: float = 0.0, training: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention with optional sinks (explicit logits, softmax in fp32 at least).

    Computed as seed 004 §5 writes it: the dense softmax weights, exactly as transformers'
    eager path computes them, times the gate ``g = Z / (Z + exp(s)) = 1 - sigmoid(s - lse(z))``.
    A sink far below every row's logsumexp gives ``g == 1.0`` in floating point, so the output
    is then bit-identical to the sink-free computation.

    Returns ``(out [B, T, HQ, D], weights [B, HQ, T, S])``; the weights are the real-token
    weights (rows sum to ``g``).
    """
    hq = query.shape[1]
    logits, allowed = masked_logits(query, key, attention_mask, scaling=scaling, softcap=softcap)
    v = expand_kv(value, hq)
    compute = torch.promote_types(query.dtype, torch.float32)
    weights = torch.softmax(logits, dim=-1, dtype=compute)
    if sinks is not None:
        lse = torch.logsumexp(logits.to(compute), dim=-1, keepdim=True)  # [B, HQ, T, 1]
        # g = 1 - a_sink rather than sigmoid(lse - s): with a tiny sink the forward still rounds
        # to exactly 1.0, but the gradient (through a_sink, not through the rounded g) survives.
        a_sink = torch.sigmoid(sinks.to(compute).view(1, hq, 1, 1) - lse)
        weights = weights * (1.0 - a_sink)
    weights = weights.masked_fill(~allowed.any(dim=-1, keepdim=True), 0.0).to(query.dtype)  # empty rows
    if dropout > 0.0 and training:
        weights = F.dropout(weights, p=dropout, training=True)
    out = torch.matmul(weights, v)  # [B, HQ, T, D]
    return out.transpose(1, 2).contiguous(), weights


def one_head_size(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """``query``, ``key``, ``value`` zero-padded on their last dimension to the widest of them.

    Fused SDPA kernels want one head size; with key and value widths apart (MLA: D_nope + rope
    vs D) PyTorch's CPU SDPA falls back to its math path, which holds every [T, S] score (5.7x
    slower at 4,096 tokens for 96-wide keys and 64-wide values; docs/results.md). Zero columns change
    no logit (q, k) and no read (v): the output's first ``Dv`` columns are the attention, exactly.
    """
    width = max(query.shape[-1], value.shape[-1])
    return tuple(F.pad(x, (0, width - x.shape[-1])) if x.shape[-1] < width else x for x in (query, key, value))


def sdpa_sink_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                        *, scaling: float, sinks: torch.Tensor | None = None, dropout: float = 0.0,
                        training: bool = False) -> tuple[torch.Tensor, None]:
    """Fused SDPA attention honouring sinks; returns ``(out [B, T, HQ, D], None)``.

    ``out = (1 - a_sink) * sdpa(q, k, v)`` (seed 004 §5: real-token weights are the dense
    ones times ``g = 1 - a_sink``). The dense part is exactly the call transformers' own SDPA
    path makes, so a converted model whose sinks are negligible (``a_sink`` below fp32
    resolution, hence ``g == 1.0``) reproduces its source bit for bit. ``a_sink`` comes from a
    second SDPA call in which the sink is a virtual key (every query gains a constant
    coordinate 1, real keys a 0 and the virtual key ``s_h / scaling``, so its logit is exactly
    ``s_h``) with value 1 and the real keys value 0.
    """
    b, hq, t, d = query.shape
    s = key.shape[2]
    dropout_p = dropout if training else 0.0
    if t == 1 and dropout_p == 0.0 and not _wants_grad(query, key, value, sinks):
        return grouped_decode_attention(query, key, value, attention_mask, scaling=scaling, sinks=sinks)
    k = expand_kv(key, hq)
    v = expand_kv(value, hq)
    # SDPA's is_causal is top-left aligned: only usable when queries and keys coincide.
    implicit_causal = attention_mask is None and (t == s or t == 1)
    mask = None if implicit_causal else allowed_mask(attention_mask, t, s, query.device)
    if sinks is not None and dropout_p > 0.0:
        raise ValueError("sdpa_sink_attention: dropout with sinks is not supported; use the eager path")
    one_call = sinks is not None and _lse_call_applies(query, k, v, sinks, dropout_p)
    if one_call:
        additive = None if mask is None else torch.zeros((), dtype=query.dtype).masked_fill(~mask, float("-inf"))
        q_, k_, v_ = one_head_size(query, k, v)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q_, k_, v_, 0.0, mask is None and t > 1, attn_mask=additive, scale=scaling)
        out = out[..., : v.shape[-1]]
        out = out * torch.sigmoid(lse - sinks.to(lse.dtype).view(1, hq, 1))[..., None]  # 1 - a_sink
    else:
        q_, k_, v_ = one_head_size(query, k, v)
        out = F.scaled_dot_product_attention(
            q_, k_, v_, attn_mask=mask, dropout_p=dropout_p, is_causal=mask is None and t > 1, scale=scaling
        )[..., : v.shape[-1]]
    if sinks is not None and not one_call:
        q_ext = torch.cat([query, query.new_ones(b, hq, t, 1)], dim=-1)  # [B, HQ, T, D+1]
        sink_coord = (sinks.to(key.dtype) / scaling).view(1, hq, 1, 1).expand(b, hq, 1, 1)
        sink_key = torch.cat([key.new_zeros(b, hq, 1, d), sink_coord], dim=-1)  # [B, HQ, 1, D+1]
        k_ext = torch.cat([torch.cat([k, k.new_zeros(b, hq, s, 1)], dim=-1), sink_key], dim=2)  # [B, HQ, S+1, D+1]
        sink_only = torch.cat([v.new_zeros(b, hq, s, 1), v.new_ones(b, hq, 1, 1)], dim=2)  # [B, HQ, S+1, 1]
        allowed = allowed_mask(attention_mask, t, s, query.device)
        allowed = torch.cat([allowed.expand(allowed.shape[0], 1, t, s), allowed.new_ones(allowed.shape[0], 1, t, 1)], dim=-1)
        a_sink = F.scaled_dot_product_attention(q_ext, k_ext, sink_only, attn_mask=allowed, scale=scaling)  # [B, HQ, T, 1]
        out = out * (1.0 - a_sink)
    if mask is not None:
        # SDPA returns a uniform mix (or NaN) for rows with no allowed key; the contract is zeros.
        empty = ~mask.any(dim=-1, keepdim=True)  # [B|1, 1, T, 1]
        out = out.masked_fill(empty, 0.0)
    return out.transpose(1, 2).contiguous(), None


DENSE_ATTENTION_PATHS = ("auto", "torch", "fla", "triton")


def fla_applies(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None,
                dropout_p: float = 0.0) -> bool:
    """Whether fla-core's ``parallel_attn`` computes this call: causal attention of T queries over
    the same T keys (no cached prefix, no padding mask, no dropout), head sizes <= 256."""
    return (attention_mask is None and query.shape[2] == key.shape[2] and dropout_p == 0.0
            and query.shape[-1] <= 256)


def fla_sink_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scaling: float,
                       sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
    """Causal attention with sinks through fla-core's Triton ``parallel_attn`` (forward and
    backward; its ``sink_bias`` adds ``exp(s_h)`` to the denominator only, as here).

    query [B, HQ, T, Dk], key [B, H, T, Dk], value [B, H, T, Dv] (HQ % H == 0) -> (out [B, T, HQ, Dv], None).
    Only for calls where :func:`fla_applies`; needs fla-core and a device Triton runs on (CUDA,
    or ``TRITON_INTERPRET=1`` on CPU).
    """
    parallel_attn = fla_parallel_attn()
    if parallel_attn is None:
        raise ValueError("dense_attention_path='fla' needs fla-core (pip install 'hf-csa2[fla]'); "
                         f"allowed without it: {', '.join(p for p in DENSE_ATTENTION_PATHS if p != 'fla')}")
    if value.shape[1] != key.shape[1]:
        value = value.expand(value.shape[0], key.shape[1], *value.shape[2:])
    sink_bias = None if sinks is None else sinks.to(query.dtype)
    out = parallel_attn(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scale=scaling,
                        sink_bias=sink_bias)
    return out, None


def decode_applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sinks, dropout_p: float = 0.0) -> bool:
    """Whether hf_csa2's decode kernel computes this call: one query position over cached keys,
    no dropout, no gradient wanted (a generation step)."""
    return query.shape[2] == 1 and dropout_p == 0.0 and not _wants_grad(query, key, value, sinks)


def decode_kernel():
    """hf_csa2's Triton decode step with sinks (``hf_csa2.kernels.decode``), or None where
    hf_csa2 is not installed or Triton cannot run (this file is also copied next to converted
    weights)."""
    try:
        from hf_csa2.kernels import available
        from hf_csa2.kernels.decode import decode_sink_attention
    except ImportError:
        return None
    return decode_sink_attention if available() else None


def fla_parallel_attn():
    """fla-core's ``parallel_attn``, or None where fla-core is not installed (this file is also
    copied next to converted weights)."""
    try:
        from fla.ops.attn.parallel import parallel_attn
    except ImportError:
        return None
    return parallel_attn


def grouped_decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, *, scaling: float,
                             sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
    """One query position (a decode step) with sinks, as one product per KV head: the HQ/H query
    heads of a group are rows of one matmul against their KV head's keys and values, which are
    never repeated per query head (MQA, or MLA's absorbed read where every query head reads the
    one latent: a head dimension broadcast with stride 0 counts as one head).

    query [B, HQ, 1, Dk], key [B, H, S, Dk], value [B, H', S, Dv] (H' = H or 1); mask as
    :func:`sdpa_sink_attention` (None = every key). Returns ``(out [B, 1, HQ, Dv], None)``;
    a row with no allowed key gives zeros.
    """
    if key.shape[1] > 1 and key.stride(1) == 0:
        key = key[:, :1]
    if value.shape[1] > 1 and value.stride(1) == 0:
        value = value[:, :1]
    b, hq, t, dk = query.shape
    h, s = key.shape[1], key.shape[2]
    if value.shape[1] != h:
        value = value.expand(b, h, s, value.shape[-1])
    compute = torch.promote_types(query.dtype, torch.float32)
    q = query.reshape(b, h, hq // h * t, dk)  # query head r = kv * (HQ/H) + j: row j of KV head kv
    z = torch.matmul(q, key.transpose(-1, -2)).to(compute) * scaling  # [B, H, HQ/H, S]
    if attention_mask is not None:
        z = z.masked_fill(~allowed_mask(attention_mask, t, s, query.device), float("-inf"))
    peak = z.amax(dim=-1, keepdim=True)
    sink = None if sinks is None else sinks.to(compute).view(1, h, hq // h, 1)
    if sink is not None:
        peak = torch.maximum(peak, sink)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    e = torch.exp(z - peak)
    denom = e.sum(dim=-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink - peak)
    out = torch.matmul(e, value.to(compute)) / torch.where(denom > 0, denom, torch.ones_like(denom))
    return out.reshape(b, hq, t, -1).transpose(1, 2).to(query.dtype).contiguous(), None


def _wants_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)


def _lse_call_applies(query, key, value, sinks, dropout_p) -> bool:
    """Whether the sink gate can come from the logsumexp of the one fused CPU call: on CPU, no
    dropout, and no gradient wanted (that op's logsumexp output has none)."""
    wants_grad = _wants_grad(query, key, value, sinks)
    return (query.device.type == "cpu" and dropout_p == 0.0 and not wants_grad
            and query.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"))


__all__ = ["DENSE_ATTENTION_PATHS", "allowed_mask", "decode_applies", "decode_kernel", "fla_applies", "fla_parallel_attn", "fla_sink_attention", "eager_sink_attention", "expand_kv", "grouped_decode_attention", "masked_logits", "one_head_size",
           "sdpa_sink_attention"]
