"""Multi-head latent attention (MLA, seed 004 §8-§12) for converted models.

Per token the layer caches only a shared latent ``c = W_DKV x`` (width ``kv_lora_rank``)
and a small rotary key (the frequency pairs listed in the spec's ``rope_pairs``); the
position-free key dims and the values are up-projections of the latent:
``k_nope_h = W_UK,h c``, ``v_h = W_UV,h c`` (``kv_b_proj``).

Layout. A source head of width ``D`` in transformers' half-split RoPE layout has ``D/2``
frequency pairs ``(i, i + D/2)``. ``rope_pairs`` lists the frequency (pair index) of each
complex slot of a rope key. Two layouts:

* one rope key per KV head (``len(rope_pairs) == num_key_value_heads``, or a single KV head):
  head ``h`` keeps RoPE on the listed pairs of its own key, the other dims are position-free;
* one rope key shared by several KV heads (``len(rope_pairs) == 1``, DeepSeek-V3 style).
  Each slot is a complex mix of the KV heads' keys at that slot's frequency (the surgery
  picks the mixes: RoPE commutes with complex scalars), a frequency may appear in several
  slots, and query head ``r`` reads slot ``s`` through a complex coefficient
  ``q_rope_coef[kv(r), s]`` applied to its own pair ``f_s``. What the slots do not capture
  stays in every head's position-free part, so every dim of every head is position-free
  there (``D_nope = D``).

Two execution paths with the same outputs:

* explicit -- up-project the cached latent to per-head keys/values, then ordinary attention
  over ``[k_nope, k_rope]`` (good for prefill: the up-projection is amortised over many
  queries);
* absorbed -- fold ``W_UK`` into the query and ``W_UV`` into the read-out (seed 004 §11):
  scores are taken against the latent itself, ``q~ = W_UK^T q_nope``, ``o = W_UV (sum_j p_j c_j)``
  (good for decode: nothing of size ``S x H x D`` is ever formed).
  Biases of ``kv_b_proj`` ride along as a constant latent coordinate 1.

QK-norm sources (Qwen3, Gemma3) normalise each full key head by its RMS before RoPE. The
per-token, per-head factor ``1/rms`` cannot be absorbed into a latent shared by the heads, so
it is cached too (one scalar per KV head per token, counted in the cache size), and the rope
key is cached after the norm.

The cache is a stock transformers Cache layer: "keys" hold the latent ``[B, 1, S, r]``,
"values" the rope keys (and key scales) ``[B, 1, S, R]``; sliding-window layers use the
sliding layer type as usual. Self-contained: copied next to converted weights.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention_base import SINK_OFF, AttentionBase, rotate_half
from .configuration_hf_csa2 import MLA_ATTENTION_PATHS, as_layer_spec
from .layer_specs import MlaSpec
from .preallocated_cache import PreallocatedLayer, PreallocatedSlidingWindowLayer, own_cache_layer


def rms_norm_eps(norm: nn.Module) -> float:
    """The epsilon of a transformers RMSNorm module (``variance_epsilon`` or ``eps``)."""
    for name in ("variance_epsilon", "eps"):
        if hasattr(norm, name):
            return float(getattr(norm, name))
    raise ValueError(f"{type(norm).__name__} has no epsilon attribute (variance_epsilon or eps)")


def rms_norm_gain(norm: nn.Module, dim: int) -> torch.Tensor:
    """Effective elementwise gain ``G`` [dim] of an RMSNorm (``norm(x) = G * x / rms(x)``),
    whatever its convention (Llama-style ``w`` or Gemma-style ``1 + w``): the norm of a vector
    whose mean square is ``1 - eps`` is ``G * sqrt(1 - eps)``."""
    eps = rms_norm_eps(norm)
    weight = next(norm.parameters())
    probe = torch.full((dim,), (1.0 - eps) ** 0.5, dtype=torch.float32, device=weight.device)
    return norm(probe).float() / (1.0 - eps) ** 0.5


def rope_dim_indices(rope_pairs: list[list[int]], head_dim: int, mixed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per rope-key head: the head dims whose frequencies the rope slots carry ([R, 2n],
    half-split order: first halves of the listed pairs, then their second halves) and the
    position-free dims ([R, D - 2n] ascending; all ``D`` dims for a ``mixed`` shared key)."""
    half = head_dim // 2
    rope, nope = [], []
    for pairs in rope_pairs:
        p = sorted(int(i) for i in pairs)
        dims = p + [i + half for i in p]
        rope.append(dims)
        nope.append(list(range(head_dim)) if mixed else [d for d in range(head_dim) if d not in set(dims)])
    return torch.tensor(rope, dtype=torch.long), torch.tensor(nope, dtype=torch.long)


class LatentRMSNorm(nn.Module):
    """RMSNorm of the latent (DeepSeek-V3's ``kv_a_layernorm``): ``w * x / rms(x)`` in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class LatentAttention(AttentionBase):
    """MLA layer built from a source attention module (adopts ``q_proj``, ``o_proj`` and the
    QK-norms); new parameters ``kv_a_proj`` [r + R*2n, hidden] and ``kv_b_proj``
    [H*(D_nope + D), r] (filled by the surgery, or by ``from_pretrained``)."""

    def __init__(self, source: nn.Module, config, layer_idx: int, spec: MlaSpec | dict):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.layer_spec = spec = as_layer_spec(spec, layer_idx, config, MlaSpec)
        self.head_dim = d = source.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = spec.num_key_value_heads
        self.kv_lora_rank = spec.kv_lora_rank
        self.scaling = source.scaling
        self.attention_dropout = getattr(source, "attention_dropout", 0.0)
        self.sliding_window = getattr(source, "sliding_window", None)
        self.softcap = getattr(source, "attn_logit_softcapping", None)
        self.is_causal = True
        self.q_proj, self.o_proj = source.q_proj, source.o_proj
        self.q_norm = getattr(source, "q_norm", None)
        self.k_norm = getattr(source, "k_norm", None)

        # A rope key shared by several KV heads mixes them: queries then read it through coefficients.
        self.mixed_rope = len(spec.rope_pairs) == 1 and self.num_key_value_heads > 1
        # Index tables as plain per-device tensors built lazily, not buffers: from_pretrained
        # builds modules on the meta device and would leave non-persistent buffers uninitialised.
        self._indices: dict[torch.device, dict[str, torch.Tensor]] = {}
        self.num_rope_heads = len(spec.rope_pairs)  # R
        self.rope_width = 2 * len(spec.rope_pairs[0])  # 2n
        self.nope_width = d if self.mixed_rope else d - self.rope_width

        # A normalised latent keeps one constant (bias-only) coordinate: see the surgery's scale_anchor.
        bias = source.k_proj.bias is not None or spec.latent_norm
        hidden = source.q_proj.in_features
        dtype = source.q_proj.weight.dtype
        self.kv_a_proj = nn.Linear(hidden, self.kv_lora_rank + self.num_rope_heads * self.rope_width, bias=bias, dtype=dtype)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_key_value_heads * (self.nope_width + d), bias=bias, dtype=dtype)
        # DeepSeek-V3 normalises the latent before caching it (needed to export to that format).
        self.kv_a_layernorm = LatentRMSNorm(self.kv_lora_rank, config.rms_norm_eps, dtype) if spec.latent_norm else None
        if self.mixed_rope:  # [H, n, (re, im)]
            self.q_rope_coef = nn.Parameter(torch.zeros(self.num_key_value_heads, self.rope_width // 2, 2, dtype=dtype))
        if spec.sinks:
            self.sinks = nn.Parameter(torch.full((self.num_heads,), SINK_OFF, dtype=dtype))
        else:
            self.sinks = None

    # -- shapes -------------------------------------------------------------------------

    def index_tables(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The layer's index tables on ``device``, derived from its spec (cached)."""
        if device not in self._indices:
            rope_dims, nope_dims = rope_dim_indices(self.layer_spec.rope_pairs, self.head_dim, self.mixed_rope)
            group = self.num_heads // self.num_key_value_heads
            kv = self.num_key_value_heads
            tables = {
                "rope_dims": rope_dims,  # [R, 2n]
                "nope_dims": nope_dims,  # [R, D_nope]
                "rope_of_kv": torch.arange(kv) if rope_dims.shape[0] > 1 else torch.zeros(kv, dtype=torch.long),  # [H]
                "kv_of_query": torch.arange(self.num_heads) // group,  # [HQ]
            }
            self._indices[device] = {k: v.to(device) for k, v in tables.items()}
        return self._indices[device]

    def _table(self, name: str) -> torch.Tensor:
        return self.index_tables(self.q_proj.weight.device)[name]

    @property
    def rope_dims(self) -> torch.Tensor:
        return self._table("rope_dims")

    @property
    def nope_dims(self) -> torch.Tensor:
        return self._table("nope_dims")

    @property
    def rope_of_kv(self) -> torch.Tensor:
        return self._table("rope_of_kv")

    @property
    def kv_of_query(self) -> torch.Tensor:
        return self._table("kv_of_query")

    @property
    def cache_width(self) -> int:
        """Cache elements per token of this layer: latent + rope keys (+ key scales)."""
        scales = self.num_key_value_heads if self.k_norm is not None else 0
        return self.kv_lora_rank + self.num_rope_heads * self.rope_width + scales

    def _up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj as [H, D_nope + D, r + 1] (bias as the last latent column) split into
        key [H, D_nope, r + 1] and value [H, D, r + 1] parts."""
        w = self.kv_b_proj.weight.view(self.num_key_value_heads, self.nope_width + self.head_dim, self.kv_lora_rank)
        b = self.kv_b_proj.bias
        b = w.new_zeros(w.shape[:2]) if b is None else b.view(w.shape[:2])
        w = torch.cat([w, b[..., None]], dim=-1)
        return w[:, : self.nope_width], w[:, self.nope_width :]

    def _key_gain(self, dims: torch.Tensor) -> torch.Tensor | None:
        """QK-norm gain at ``dims`` (any index shape), or None without QK-norm."""
        if self.k_norm is None:
            return None
        return rms_norm_gain(self.k_norm, self.head_dim)[dims]

    # -- write side: what one token contributes to the cache ------------------------------

    def compress(self, hidden_states: torch.Tensor, position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden_states [B, T, hidden] -> (latent [B, 1, T, r], rope part [B, 1, T, R*2n (+H)]).

        The rope part holds the rotated rope keys of every rope head and, for QK-norm
        sources, each KV head's key scale ``1/rms`` (appended last).
        """
        b, t, _ = hidden_states.shape
        r, nr, w = self.kv_lora_rank, self.num_rope_heads, self.rope_width
        a = self.kv_a_proj(hidden_states)
        latent, rope = a[..., :r], a[..., r:].view(b, t, nr, w)  # [B, T, r], [B, T, R, 2n]
        if self.kv_a_layernorm is not None:
            latent = self.kv_a_layernorm(latent)
        parts = []
        if self.k_norm is not None:
            # Rebuild each KV head's full pre-norm key to get its RMS, as the source's norm does.
            k_up, _ = self._up_weights()  # [H, D_nope, r+1]
            latent1 = torch.cat([latent, latent.new_ones(b, t, 1)], dim=-1)
            k_nope = torch.einsum("btr,hdr->bthd", latent1, k_up)  # [B, T, H, D_nope]
            rope_h = rope[:, :, self.rope_of_kv]  # [B, T, H, 2n]
            mean_sq = (k_nope.float().pow(2).sum(-1) + rope_h.float().pow(2).sum(-1)) / self.head_dim
            scale = torch.rsqrt(mean_sq + rms_norm_eps(self.k_norm)).to(latent.dtype)  # [B, T, H]
            rope = rope_h * scale[..., None] * self._key_gain(self.rope_dims[self.rope_of_kv]).to(rope.dtype)  # [B, T, H, 2n]
            parts.append(scale)
        dims = self.rope_dims if self.k_norm is None else self.rope_dims[self.rope_of_kv]
        cos, sin = self._rope_cos_sin(position_embeddings, dims)
        rope = rope.transpose(1, 2)  # [B, R|H, T, 2n]
        rope = rope * cos + rotate_half(rope) * sin
        rope = rope.transpose(1, 2).reshape(b, t, -1)
        return latent[:, None], torch.cat([rope, *parts], dim=-1)[:, None]

    @staticmethod
    def _rope_cos_sin(position_embeddings, dims: torch.Tensor):
        """cos/sin [B, T, D] gathered at ``dims`` [G, 2n] -> [B, G, T, 2n]."""
        cos, sin = position_embeddings
        return cos[..., dims].transpose(1, 2), sin[..., dims].transpose(1, 2)

    def _split_cached(self, rope_part: torch.Tensor):
        """rope part [B, 1, S, X] -> (rope keys per KV head [B, H, S, 2n], key scales [B, H, S] or None)."""
        b, _, s, _ = rope_part.shape
        x = rope_part[:, 0]
        if self.k_norm is None:
            rope = x.view(b, s, self.num_rope_heads, self.rope_width)[:, :, self.rope_of_kv]
            return rope.transpose(1, 2), None
        h = self.num_key_value_heads
        rope = x[..., : h * self.rope_width].view(b, s, h, self.rope_width)
        return rope.transpose(1, 2), x[..., h * self.rope_width :].transpose(1, 2)

    # -- read side ------------------------------------------------------------------------

    def queries(self, hidden_states: torch.Tensor, position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden_states [B, T, hidden] -> (q_nope [B, HQ, T, D_nope], rotated q_rope [B, HQ, T, 2n])."""
        b, t, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, t, self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = q.transpose(1, 2)  # [B, HQ, T, D]
        rope_head = self.rope_of_kv[self.kv_of_query]  # [HQ]
        nope_idx = self.nope_dims[rope_head][None, :, None, :].expand(b, -1, t, -1)
        rope_idx = self.rope_dims[rope_head][None, :, None, :].expand(b, -1, t, -1)
        q_nope, q_rope = q.gather(-1, nope_idx), q.gather(-1, rope_idx)
        if self.mixed_rope:  # complex coefficient per (KV group, slot): (a + ib)(re + i im)
            coef = self.q_rope_coef[self.kv_of_query][None, :, None]  # [1, HQ, 1, n, 2]
            re, im = q_rope.chunk(2, dim=-1)
            a, b = coef[..., 0], coef[..., 1]
            q_rope = torch.cat([a * re - b * im, a * im + b * re], dim=-1)
        cos, sin = self._rope_cos_sin(position_embeddings, self.rope_dims[rope_head])
        return q_nope, q_rope * cos + rotate_half(q_rope) * sin

    def cache_layer_kind(self) -> tuple[type, dict]:
        """The cache layer class (and its arguments) of this layer's latent entries: one that
        appends in place (a decode step copies no earlier entry); a window for sliding layers."""
        if self.sliding_window:
            return PreallocatedSlidingWindowLayer, {"sliding_window": self.sliding_window}
        return PreallocatedLayer, {}

    def use_absorbed(self, q_len: int) -> bool:
        path = getattr(self.config, "mla_attention_path", "auto") or "auto"
        if path not in MLA_ATTENTION_PATHS:  # the config checks at load; this catches later edits
            raise ValueError(f"mla_attention_path={path!r}; allowed: {', '.join(MLA_ATTENTION_PATHS)}")
        return path == "absorbed" or (path == "auto" and q_len == 1)

    def attention_output(self, hidden_states: torch.Tensor, position_embeddings, attention_mask=None, cache=None,
                         **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Everything but ``o_proj``: hidden_states [B, T, hidden] -> ([B, T, HQ*D], weights or None)."""
        b, t, _ = hidden_states.shape
        latent, rope_part = self.compress(hidden_states, position_embeddings)
        layer = None
        if cache is not None:
            layer = own_cache_layer(self, cache, required=False)
            latent, rope_part = cache.update(latent, rope_part, self.layer_idx, kwargs=kwargs)
        q_nope, q_rope = self.queries(hidden_states, position_embeddings)
        if self.use_absorbed(t):
            out, weights = self._absorbed(q_nope, q_rope, latent, rope_part, attention_mask, layer, **kwargs)
        else:
            k_rope, k_scale = self._split_cached(rope_part)
            out, weights = self._explicit(q_nope, q_rope, latent, k_rope, k_scale, attention_mask, **kwargs)
        return out.reshape(b, t, -1).contiguous(), weights

    def _explicit_keys_values(self, latent, k_rope, k_scale) -> tuple[torch.Tensor, torch.Tensor]:
        """Up-projected keys [B, H, S, D_nope + 2n] (position-free dims first) and values [B, H, S, D]."""
        b, _, s, _ = latent.shape
        kv = self.kv_b_proj(latent[:, 0]).view(b, s, self.num_key_value_heads, -1).transpose(1, 2)
        k_nope, v = kv[..., : self.nope_width], kv[..., self.nope_width :]  # [B, H, S, D_nope], [B, H, S, D]
        if k_scale is not None:
            gain = self._key_gain(self.nope_dims[self.rope_of_kv]).to(k_nope.dtype)  # [H, D_nope]
            k_nope = k_nope * k_scale[..., None] * gain[None, :, None, :]
        return torch.cat([k_nope, k_rope], dim=-1), v

    def scoring_qk(self, hidden_states: torch.Tensor, position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries [B, HQ, T, Dk] and keys [B, H, T, Dk] whose scaled dot products are this
        layer's attention logits (no cache); used by calibration."""
        latent, rope_part = self.compress(hidden_states, position_embeddings)
        q_nope, q_rope = self.queries(hidden_states, position_embeddings)
        k_rope, k_scale = self._split_cached(rope_part)
        k, _ = self._explicit_keys_values(latent, k_rope, k_scale)
        return torch.cat([q_nope, q_rope], dim=-1), k

    def _explicit(self, q_nope, q_rope, latent, k_rope, k_scale, attention_mask, **kwargs):
        k, v = self._explicit_keys_values(latent, k_rope, k_scale)
        return self.attend(torch.cat([q_nope, q_rope], dim=-1), k, v, attention_mask, **kwargs)

    def absorbed_operands(self, q_nope, q_rope, latent, rope_part, layer=None):
        """Queries/keys/values of the absorbed path: the latent itself is read.

        Returns (q [B, HQ, T, r+1+2n], k [B, H or 1, S, r+1+2n] (one key head when every KV head
        reads the same keys), values = latent1 [B, 1, S, r+1], v_up [H, D, r+1]); the output of
        head r is ``v_up[kv(r)] @ (sum_j p_j latent1_j)``. ``layer``: this layer's cache layer; one
        that keeps derived rows (``preallocated_cache``) keeps k and latent1, so that a decode step
        computes them for its own rows only instead of copying the whole cache into them.
        """
        k_up, v_up = self._up_weights()  # [H, D_nope, r+1], [H, D, r+1]
        if self.k_norm is not None:  # keys carry a QK-norm scale: its gain goes into the query side
            gain = self._key_gain(self.nope_dims[self.rope_of_kv]).to(k_up.dtype)  # [H, D_nope]
            k_up = k_up * gain[..., None]
        # q~ = W_UK^T q_nope per query head, with the bias column giving q_nope . b_k.
        q_lat = torch.einsum("bhtd,hdr->bhtr", q_nope, k_up[self.kv_of_query])  # [B, HQ, T, r+1]
        if not hasattr(layer, "derived_rows"):
            k, latent1 = self.absorbed_keys(latent, rope_part)
        else:
            s = latent.shape[2]

            def rows(i):
                return lambda lo, hi: self.absorbed_keys(latent[:, :, lo:hi], rope_part[:, :, lo:hi])[i]

            k = layer.derived_rows("absorbed_keys", rows(0), s)
            # one key head: its first r+1 columns are latent1
            latent1 = k[..., : self.kv_lora_rank + 1] if k.shape[1] == 1 else layer.derived_rows("latent1", rows(1), s)
        return torch.cat([q_lat, q_rope], dim=-1), k, latent1, v_up

    def absorbed_keys(self, latent: torch.Tensor, rope_part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached rows (latent [B, 1, S, r], rope part [B, 1, S, X]) -> (absorbed keys
        [B, H or 1, S, r+1+2n], latent1 [B, 1, S, r+1]), each row from its own row only."""
        k_rope, k_scale = self._split_cached(rope_part)  # [B, H, S, 2n], [B, H, S] or None
        b, _, s, _ = latent.shape
        latent1 = torch.cat([latent, latent.new_ones(b, 1, s, 1)], dim=-1)  # [B, 1, S, r+1]
        if k_scale is None:
            if self.num_rope_heads == 1:
                k_rope = k_rope[:, :1]  # every KV head has the same keys
            k_lat = latent1.expand(b, k_rope.shape[1], s, -1)
        else:
            k_lat = latent1 * k_scale[..., None]  # [B, H, S, r+1]
        return torch.cat([k_lat, k_rope], dim=-1), latent1

    def _absorbed(self, q_nope, q_rope, latent, rope_part, attention_mask, layer=None, **kwargs):
        q, k, latent1, v_up = self.absorbed_operands(q_nope, q_rope, latent, rope_part, layer)
        k = k.expand(-1, self.num_key_value_heads, -1, -1)
        out_lat, weights = self.attend(q, k, latent1, attention_mask, **kwargs)  # [B, T, HQ, r+1]
        out = torch.einsum("bthr,hdr->bthd", out_lat, v_up[self.kv_of_query])
        return out, weights


__all__ = ["LatentAttention", "LatentRMSNorm", "MLA_ATTENTION_PATHS", "rms_norm_gain", "rope_dim_indices"]
