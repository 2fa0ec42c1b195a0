"""Dense softmax attention (any KV-head count, optional sink logits) adopting a source
attention module's projections.

Self-contained (torch + transformers only): copied next to converted weights.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention_base import SINK_OFF, AttentionBase, apply_rotary
from .configuration_hf_csa2 import as_layer_spec
from .layer_specs import AttentionSpec


class DenseSinkAttention(AttentionBase):
    """Dense softmax attention with a per-layer KV-head count and optional per-head sinks.

    Built from a source attention module (e.g. ``LlamaAttention`` or ``Gemma3Attention``)
    whose projections/QK-norms it adopts; the forward is the one all supported sources share:
    project -> (QK-norm) -> RoPE -> cache -> softmax attention (+ sinks) -> o_proj.
    """

    def __init__(self, source: nn.Module, config, layer_idx: int, spec: AttentionSpec | dict):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.layer_spec = spec = as_layer_spec(spec, layer_idx, config)
        self.head_dim = source.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = spec.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = source.scaling
        self.attention_dropout = getattr(source, "attention_dropout", 0.0)
        self.sliding_window = getattr(source, "sliding_window", None)
        self.softcap = getattr(source, "attn_logit_softcapping", None)
        self.is_causal = True
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = source.q_proj, source.k_proj, source.v_proj, source.o_proj
        self.q_norm = getattr(source, "q_norm", None)
        self.k_norm = getattr(source, "k_norm", None)
        if spec.sinks:
            self.sinks = nn.Parameter(torch.full((self.num_heads,), SINK_OFF, dtype=source.q_proj.weight.dtype))
        else:
            self.sinks = None

    def project_plain(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """hidden_states [B, T, hidden] -> q [B, HQ, T, D], k/v [B, H, T, D] (QK-norm, no RoPE)."""
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape)  # [B, T, HQ, D]
        k = self.k_proj(hidden_states).view(hidden_shape)  # [B, T, H, D]
        v = self.v_proj(hidden_states).view(hidden_shape)  # [B, T, H, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def project(self, hidden_states: torch.Tensor, position_embeddings) -> tuple[torch.Tensor, ...]:
        """hidden_states [B, T, hidden] -> q [B, HQ, T, D], k/v [B, H, T, D] (RoPE applied)."""
        q, k, v = self.project_plain(hidden_states)
        cos, sin = position_embeddings
        q, k = apply_rotary(q, k, cos, sin)
        return q, k, v

    def scoring_qk(self, hidden_states: torch.Tensor, position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries [B, HQ, T, D] and keys [B, H, T, D] whose scaled dot products are this
        layer's attention logits (no cache); used by calibration."""
        q, k, _ = self.project(hidden_states, position_embeddings)
        return q, k

    def attention_output(self, hidden_states: torch.Tensor, position_embeddings, attention_mask=None, cache=None,
                         **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Everything but ``o_proj``: hidden_states [B, T, hidden] -> ([B, T, HQ*D], weights or None)."""
        input_shape = hidden_states.shape[:-1]
        q, k, v = self.project(hidden_states, position_embeddings)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)

        out, weights = self.attend(q, k, v, attention_mask, **kwargs)
        return out.reshape(*input_shape, -1).contiguous(), weights


__all__ = ["DenseSinkAttention"]
