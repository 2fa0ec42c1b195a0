"""What every hf-csa2 attention module shares: RoPE helpers and the dispatch to an attention
implementation that honours sink logits.

Self-contained (torch + transformers only): copied next to converted weights.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .layer_specs import AttentionSpec
from .sink_attention import (DENSE_ATTENTION_PATHS, decode_applies, decode_kernel, eager_sink_attention, fla_applies,
                             fla_parallel_attn, fla_sink_attention, sdpa_sink_attention)

# A sink this far below any row's logsumexp contributes exp(-1e4) == 0 in fp32: "no sink".
SINK_OFF = -1.0e4
SINK_CAPABLE_IMPLEMENTATIONS = ("eager", "sdpa")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in transformers' half-split layout. x [B, H, T, D]; cos/sin [B, T, D]."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """RoPE in transformers' half-split layout. q/k [B, H, T, D]; cos/sin [B, T, D]."""
    return rotate(q, cos, sin), rotate(k, cos, sin)


class AttentionBase(nn.Module):
    """Base of the attention modules of a converted model.

    Subclasses provide ``attention_output(hidden_states, position_embeddings, attention_mask,
    cache, **kwargs) -> ([B, T, HQ*D], weights)`` (everything but ``o_proj``) and
    ``scoring_qk(hidden_states, position_embeddings) -> (q, k)`` (the logits are
    ``scaling * q k^T``), and set
    ``config``, ``layer_spec`` (the layer's typed spec), ``scaling``, ``sinks``, ``softcap``,
    ``sliding_window``, ``attention_dropout`` and ``o_proj``.
    """

    layer_spec: AttentionSpec

    @property
    def spec(self) -> dict:
        """The layer's spec in its config.json form, for callers that read it by key."""
        return self.layer_spec.to_dict()

    def attend(self, query, key, value, attention_mask, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Softmax attention (+ sinks) with the configured implementation.

        query [B, HQ, T, Dk], key [B, H, S, Dk], value [B, H', S, Dv] (H and H' divide HQ)
        -> ([B, T, HQ, Dv], weights or None).
        """
        impl = self.config._attn_implementation or "eager"
        dropout = self.attention_dropout if self.training else 0.0
        if impl == "eager":
            return eager_sink_attention(
                query, key, value, attention_mask, scaling=self.scaling, sinks=self.sinks,
                softcap=self.softcap, dropout=dropout, training=self.training,
            )
        if impl == "sdpa" and self.softcap is None:
            decode = self._decode_kernel(query, key, value, dropout)
            if decode is not None:
                return decode(query, key, value, attention_mask, scaling=self.scaling, sinks=self.sinks)
            if self._uses_fla(query, key, attention_mask, dropout):
                return fla_sink_attention(query, key, value, scaling=self.scaling, sinks=self.sinks)
            return sdpa_sink_attention(
                query, key, value, attention_mask, scaling=self.scaling, sinks=self.sinks,
                dropout=dropout, training=self.training,
            )
        if self.sinks is not None or self.softcap is not None:
            raise ValueError(
                f"attn_implementation={impl!r} cannot honour this layer's "
                f"{'sink logits' if self.sinks is not None else 'logit soft-capping'}; "
                f"allowed: {', '.join(SINK_CAPABLE_IMPLEMENTATIONS)}"
            )
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(impl, None)
        return attention(
            self, query, key, value, attention_mask, dropout=dropout, scaling=self.scaling,
            sliding_window=self.sliding_window, **kwargs,
        )

    def _decode_kernel(self, query, key, value, dropout):
        """hf_csa2's Triton decode step where ``dense_attention_path`` asks for it and the call is a
        decode step (:func:`decode_applies`): "triton" always (refused where it cannot run), "auto"
        for layers with sinks on CUDA where it can run (as for fla-core); else None (the torch path)."""
        path = getattr(self.config, "dense_attention_path", "auto") or "auto"
        if path not in ("triton", "auto") or not decode_applies(query, key, value, self.sinks, dropout):
            return None
        kernel = decode_kernel()
        if path == "triton" and kernel is None:
            raise ValueError("dense_attention_path='triton' needs the hf-csa2 package with Triton (pip install "
                             "'hf-csa2[triton]') and a CUDA device, or TRITON_INTERPRET=1; allowed without them: "
                             f"{', '.join(p for p in DENSE_ATTENTION_PATHS if p != 'triton')}")
        return kernel if path == "triton" or (self.sinks is not None and query.device.type == "cuda") else None

    def _uses_fla(self, query, key, attention_mask, dropout) -> bool:
        """``dense_attention_path``: "fla" and "triton" take fla-core's kernel wherever it applies (a
        causal prefill or training window: :func:`fla_applies`; cached decode steps stay on torch
        under "fla" and take hf_csa2's decode kernel under "triton"); "auto" does so for layers with
        sinks on CUDA where fla-core is installed (without sinks transformers' SDPA / flash paths
        already fuse the op); "torch" never."""
        path = getattr(self.config, "dense_attention_path", "auto") or "auto"
        if path == "torch" or not fla_applies(query, key, attention_mask, dropout):
            return False
        if path in ("fla", "triton"):
            return True
        return self.sinks is not None and query.device.type == "cuda" and fla_parallel_attn() is not None

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden_states [B, T, hidden] -> ([B, T, hidden], attention weights or None)."""
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        out, weights = self.attention_output(hidden_states, position_embeddings, attention_mask, cache, **kwargs)
        return self.o_proj(out), weights


__all__ = ["AttentionBase", "SINK_CAPABLE_IMPLEMENTATIONS", "SINK_OFF", "apply_rotary", "rotate", "rotate_half"]
