"""Dense attention over low-rank codes of the layer's own keys and values.

Per token the layer caches two short codes: ``c_k = A_k x`` (width ``key_rank``) and
``c_v = A_v x`` (width ``value_rank``). When it reads, every cached position's key and value are
rebuilt from them: ``k = norm(B_k c_k)`` rotated by RoPE at that position, ``v = B_v c_v``; the
queries and the output projection are the source's own.

Why codes of keys taken BEFORE RoPE: a retrieval layer (one that reads a fact back from far in
the prompt) needs keys and values of its own at every far position, and keys with every
dimension still rotated (MLA's latent keeps RoPE on only a few dims). RoPE rotates a key by its
position, so no fixed basis can compress rotated keys; the plain key lives in a fixed subspace,
and rotating after the rebuild keeps each dimension's position exactly (docs/results.md,
"which global layer reads the far facts": own keys and values at rank 128 bring the far
answers back where a shared latent cannot).

Key positions. Without a cache the keys are the queries' tokens: their positions are the
``position_embeddings`` the model passes. With a cache the layer holds a contiguous run of
tokens ending at the newest query (a full cache, or a sliding one for a sliding layer), so key
``j`` of ``S`` sits at ``last - (S - 1 - j)``; RoPE for those positions comes from the model's
own rotary module (``key_rotary``, set by :class:`Csa2ForCausalLM`). Rows of a left-padded batch
get positions below 0 for their padding, which the mask hides: with a cache the layer builds its
mask from positions and the rows' first real tokens (``csa2_row_starts``), as CSA2 layers do.

Self-contained (torch + transformers only): copied next to converted weights.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .attention_base import rotate
from .dense_attention import DenseSinkAttention
from .layer_specs import LowRankSpec


class LowRankKVAttention(DenseSinkAttention):
    """:class:`DenseSinkAttention` whose keys and values pass through rank-``r`` codes, and whose
    cache holds the codes: ``[B, 1, S, key_rank]`` as "keys", ``[B, 1, S, value_rank]`` as "values".

    ``k_down`` / ``v_down`` (hidden -> rank, with the source projection's bias when it has one)
    and ``k_up`` / ``v_up`` (rank -> num_key_value_heads * head_dim, no bias) replace ``k_proj`` /
    ``v_proj``; their fresh values are set by the surgery (``hf_csa2.surgery.lowrank``).
    """

    def __init__(self, source: nn.Module, config, layer_idx: int, spec: LowRankSpec | dict):
        super().__init__(source, config, layer_idx, spec)
        spec = self.layer_spec
        ref = source.k_proj.weight
        hidden, width = ref.shape[1], spec.num_key_value_heads * self.head_dim
        kw = {"dtype": ref.dtype, "device": ref.device}
        bias = source.k_proj.bias is not None
        self.k_down = nn.Linear(hidden, spec.key_rank, bias=bias, **kw)
        self.k_up = nn.Linear(spec.key_rank, width, bias=False, **kw)
        self.v_down = nn.Linear(hidden, spec.value_rank, bias=source.v_proj.bias is not None, **kw)
        self.v_up = nn.Linear(spec.value_rank, width, bias=False, **kw)
        del self.k_proj, self.v_proj
        # The source's window: its attention module's, or (Mistral: none there) its config's.
        self.mask_window = (source.sliding_window if hasattr(source, "sliding_window")
                            else getattr(getattr(source, "config", None), "sliding_window", None))
        # (hidden_states, position_ids [B, S]) -> (cos, sin) [B, S, D]: the model's rotary module
        # for this layer. A plain attribute, not a submodule: the model owns that module.
        self.key_rotary: Callable | None = None

    def codes(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden_states [B, T, hidden] -> key codes [B, 1, T, key_rank], value codes [B, 1, T, value_rank]."""
        return self.k_down(hidden_states)[:, None], self.v_down(hidden_states)[:, None]

    def expand(self, key_codes: torch.Tensor, value_codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes [B, 1, S, r] -> plain keys (QK-norm, no RoPE) and values [B, H, S, D]."""
        shape = (*key_codes.shape[:1], key_codes.shape[2], self.num_key_value_heads, self.head_dim)
        k = self.k_up(key_codes[:, 0]).view(shape)
        v = self.v_up(value_codes[:, 0]).view(shape)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return k.transpose(1, 2), v.transpose(1, 2)

    def project_plain(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """hidden_states [B, T, hidden] -> q [B, HQ, T, D], k/v [B, H, T, D] rebuilt from their codes (no RoPE)."""
        q = self.q_proj(hidden_states).view(*hidden_states.shape[:-1], -1, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        k, v = self.expand(*self.codes(hidden_states))
        return q.transpose(1, 2), k, v

    def key_position_embeddings(self, hidden_states: torch.Tensor, position_embeddings, position_ids,
                                num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [B, S, D] for the ``num_keys`` keys read, the newest of them the last query."""
        cos, sin = position_embeddings
        if num_keys == cos.shape[-2]:
            return cos, sin
        if self.key_rotary is None:
            raise RuntimeError(f"layer {self.layer_idx}: a lowrank layer reading a cache needs the model's rotary "
                               "module (key_rotary); build it through Csa2ForCausalLM")
        if position_ids is None:  # transformers' default: the queries follow the cached tokens
            position_ids = torch.arange(num_keys - cos.shape[-2], num_keys, device=cos.device)[None]
        last = position_ids[:, -1:]
        keys = last - (num_keys - 1) + torch.arange(num_keys, device=last.device)[None]
        return self.key_rotary(hidden_states, keys)

    def position_mask(self, total: int, num_queries: int, num_keys: int, starts: torch.Tensor | None) -> torch.Tensor:
        """Bool mask [B|1, 1, T, S] (True = may attend) of the last ``num_queries`` of ``total``
        tokens over the last ``num_keys`` (what the cache returned): causal, within the source's
        sliding window, and (``starts`` [B], each row's first real token) never on left padding.

        Built from positions rather than taken from the model: in a model whose layers keep
        windows of different widths, transformers sizes one mask per layer type from the first
        layer of that type, which need not be this one."""
        device = self.q_proj.weight.device
        q = torch.arange(total - num_queries, total, device=device)[:, None]
        k = torch.arange(total - num_keys, total, device=device)[None, :]
        allowed = k <= q
        if self.mask_window:
            allowed = allowed & (q - k < self.mask_window)
        allowed = allowed[None, None]
        if starts is not None:
            allowed = allowed & (k >= starts.to(device)[:, None])[:, None, None]
        return allowed

    def attention_output(self, hidden_states: torch.Tensor, position_embeddings, attention_mask=None, cache=None,
                         **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Everything but ``o_proj``: hidden_states [B, T, hidden] -> ([B, T, HQ*D], weights or None)."""
        input_shape = hidden_states.shape[:-1]
        q = self.q_proj(hidden_states).view(*input_shape, -1, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = rotate(q.transpose(1, 2), *position_embeddings)
        key_codes, value_codes = self.codes(hidden_states)
        if cache is not None:
            key_codes, value_codes = cache.update(key_codes, value_codes, self.layer_idx, kwargs=kwargs)
            attention_mask = self.position_mask(cache.layers[self.layer_idx].get_seq_length(), input_shape[1],
                                                key_codes.shape[2], kwargs.get("csa2_row_starts"))
        k, v = self.expand(key_codes, value_codes)
        k_cos, k_sin = self.key_position_embeddings(hidden_states, position_embeddings, kwargs.get("position_ids"),
                                                    k.shape[2])
        k = rotate(k, k_cos.to(k.dtype), k_sin.to(k.dtype))
        out, weights = self.attend(q, k, v, attention_mask, **kwargs)
        return out.reshape(*input_shape, -1).contiguous(), weights


__all__ = ["LowRankKVAttention"]
