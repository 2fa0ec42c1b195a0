"""The public function of the decode kernels: the contract of its torch reference."""

from __future__ import annotations

import torch

from .. import require_available

_REFERENCE = "hf_csa2.model.sink_attention.grouped_decode_attention"


def _kernels():
    # Triton is imported on first use only, so this package imports without it
    from . import kernel

    return kernel


def _one_head_if_broadcast(x: torch.Tensor) -> torch.Tensor:
    # a head dimension expanded with stride 0 (MLA's one latent) is one head: read it once
    return x[:, :1] if x.shape[1] > 1 and x.stride(1) == 0 else x


def _step_mask(attention_mask: torch.Tensor, s: int) -> torch.Tensor:
    """[B|1, S] bool (True = may attend) of a decode step's transformers mask: bool, or additive
    (0 allowed, dtype-min masked), [B|1, 1, 1, S'] with S' >= S."""
    mask = attention_mask if attention_mask.dtype == torch.bool else (
        attention_mask > torch.finfo(attention_mask.dtype).min / 2)
    return mask[..., -1, :s].reshape(mask.shape[0], s)


def decode_sink_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, *, scaling: float,
                          sinks: torch.Tensor | None = None, split_len: int | None = None) -> tuple[torch.Tensor, None]:
    """The Triton version of :func:`hf_csa2.model.sink_attention.grouped_decode_attention`.

    Args:
        query: [B, HQ, 1, Dk], one query position.
        key: [B, H, S, Dk] (HQ % H == 0; query head r reads KV head r // (HQ/H)); a head
            dimension broadcast with stride 0 counts as one head.
        value: [B, H', S, Dv], H' = H or 1; Dv may differ from Dk.
        attention_mask: None (every key), or a transformers mask of the step (bool, True = may
            attend, or additive float) broadcastable to [B, 1, 1, S].
        scaling: the logit scale.
        sinks: per-query-head sink logits [HQ] (denominator only), or None.
        split_len: keys per split (None: chosen for the device); any value gives the same result.

    Returns:
        ``(out [B, 1, HQ, Dv] in the query's dtype, None)``; a row with no allowed key gives zeros.
        Not differentiable (a decode step).
    """
    require_available("decode_sink_attention", _REFERENCE)
    kernel = _kernels()
    if query.dim() != 4 or query.shape[2] != 1:
        raise ValueError(f"query {tuple(query.shape)}: expected [B, HQ, 1, Dk] (one decode position)")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.dtype not in kernel.SUPPORTED_DTYPES:
            raise ValueError(f"{name} is {x.dtype}; the kernel takes {', '.join(map(str, kernel.SUPPORTED_DTYPES))}")
    b, hq, _, dk = query.shape
    if key.dim() != 4 or key.shape[0] != b or key.shape[3] != dk or hq % key.shape[1]:
        raise ValueError(f"key {tuple(key.shape)}: expected [{b}, H, S, {dk}] with H dividing {hq}")
    if value.dim() != 4 or value.shape[0] != b or value.shape[2] != key.shape[2] or value.shape[1] not in (1, key.shape[1]):
        raise ValueError(f"value {tuple(value.shape)}: expected [{b}, {key.shape[1]} or 1, {key.shape[2]}, Dv]")
    if sinks is not None and tuple(sinks.shape) != (hq,):
        raise ValueError(f"sinks {tuple(sinks.shape)}: expected [{hq}]")
    if not kernel.INTERPRETED and query.device.type != "cuda":
        raise ValueError(f"inputs on {query.device}: the compiled kernel needs CUDA tensors (or set TRITON_INTERPRET=1 "
                         "before importing triton to run it in the CPU interpreter)")
    k, v = _one_head_if_broadcast(key), _one_head_if_broadcast(value)
    if k.shape[1] != key.shape[1] and v.shape[1] != 1:
        k = key  # the values still have their heads: read the keys per head too
    h, s = k.shape[1], k.shape[2]
    if v.shape[1] != h:
        v = v.expand(b, h, s, v.shape[-1])  # stride 0: read once per KV head
    allowed = None
    if attention_mask is not None:
        allowed = _step_mask(attention_mask, s).expand(b, s).to(torch.int8)
    out = kernel.decode_forward(query.detach()[:, :, 0], k.detach(), v.detach(), allowed, scaling,
                                None if sinks is None else sinks.detach().float(), split_len)
    return out[:, None].to(query.dtype), None


__all__ = ["decode_sink_attention"]
