"""CSA2 shared-KV sparse attention layers (seed 000; DeepSeek-V4.1 "CSA2" style).

Per layer a mode (``spec.mode``; the specs are in ``layer_specs.py``):

* ``full``    -- an MLA layer (:class:`LatentAttention`) whose latent entries ``c_j`` (and
  rope keys) plus one index key per token are cached once for the whole model. Its own
  indexer picks Top-K entries among positions older than its window; it reads Top-K + its
  last ``window`` entries in one softmax (absorbed form: scores and read-out in latent space).
  With ``exact_window`` it reads its last ``window`` tokens from its own exact keys/values
  (a ring, as the other modes do) and only the Top-K far entries from the latent.
* ``reindex`` -- reads a full layer's entries with its own Top-K: its own index queries scored
  against that layer's cached index keys.
* ``reuse``   -- reads a full layer's entries at the Top-K addresses its source (full or
  reindex) picked; only its queries are its own.
* ``swa``     -- only its own window.

Every non-full layer keeps its OWN exact keys/values of the last ``window`` tokens (a sliding
cache layer): the only non-frozen part of what a Reuse layer reads (seed 000 §5.7). Reindex/
Reuse layers read the shared entries through an :class:`EntryReader`: per KV head a map from
the source's latent to keys/values in this layer's own head space, absorbed into the query and
the read-out, and complex coefficients for the source's rope-key slots. One softmax spans the
Top-K entries and the window, with per-head sinks.

Cache (transformers' dynamic layers, appending in place: ``preallocated_cache.py``): full layers
use a ``PreallocatedIndexedLayer`` (keys = latent ``[B, 1, S, r]``, values = rope part,
``indexer_keys`` ``[B, S, d_I]``; with ``exact_window`` a :class:`DynamicIndexedWindowLayer` that
also holds the exact ring); the others a ``PreallocatedSlidingWindowLayer`` (their own
``[B, H, W-1, D]`` keys/values), or with ``sink_tokens: P`` a
:class:`DynamicSinkWindowLayer` that also keeps the first P tokens once they leave the window. A cache built without knowledge of these layers
(``DynamicCache()`` or ``DynamicCache(config=...)``) gets the right layer objects on first use.
Layers find the entries of earlier layers through ``peers`` (the model's attention modules),
filled during the same forward (``scratch``). Left-padded batches: the model passes each row's
first real position (``csa2_row_starts`` [B]) and no read or pick ever lands before it, so every row
reads what it would alone (right padding needs nothing: no real token reads a later one).

Self-contained (torch + transformers only): copied next to converted weights.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention_base import apply_rotary, rotate_half
from .configuration_hf_csa2 import as_layer_spec
from .dense_attention import DenseSinkAttention
from .indexer import Indexer
from .latent_attention import LatentAttention
from .layer_specs import Csa2FullSpec, Csa2ReaderSpec, MlaSpec
from .preallocated_cache import PreallocatedIndexedLayer, PreallocatedSlidingWindowLayer, own_cache_layer
from .sparse_attention import SparseSegment, drop_padding, sparse_sink_attention, uses_fused_kernels, window_index


def read_path(config) -> str:
    """How this model's CSA2 layers read their entries (``csa2_read_path``; configs built before it: auto)."""
    return getattr(config, "csa2_read_path", "auto") or "auto"


class DynamicSinkWindowLayer(PreallocatedSlidingWindowLayer):
    """A sliding-window cache layer that keeps the first ``sink_tokens`` tokens for good once
    they leave the window (``sink_keys``/``sink_values`` ``[B, H, <=P, D]``; StreamingLLM's
    attention sinks). Every token is held once: after ``n`` tokens it holds ``min(n, W-1+P)``."""

    def __init__(self, sliding_window: int, sink_tokens: int, **kwargs):
        super().__init__(sliding_window=sliding_window, **kwargs)
        self.sink_tokens = sink_tokens
        self.sink_keys = self.sink_values = None

    @property
    def sinks_held(self) -> int:
        return 0 if self.sink_keys is None else self.sink_keys.shape[-2]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        ring = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        start = self.cumulative_length - ring  # position of the ring's first row
        end = self.cumulative_length + key_states.shape[-2]
        # Positions below `stop` are out of the ring after this update: keep the first ones.
        stop = min(self.sink_tokens, max(end - self.sliding_window + 1, 0))
        if stop > self.sinks_held:
            lo, hi = self.sinks_held - start, stop - start
            k = torch.cat([self.keys, key_states], dim=-2) if ring else key_states
            v = torch.cat([self.values, value_states], dim=-2) if ring else value_states
            new_k, new_v = k[:, :, lo:hi], v[:, :, lo:hi]
            self.sink_keys = new_k if self.sink_keys is None else torch.cat([self.sink_keys, new_k], dim=-2)
            self.sink_values = new_v if self.sink_values is None else torch.cat([self.sink_values, new_v], dim=-2)
        return super().update(key_states, value_states, *args, **kwargs)

    def _map_sinks(self, fn) -> None:
        if self.sink_keys is not None:
            self.sink_keys, self.sink_values = fn(self.sink_keys), fn(self.sink_values)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._map_sinks(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._map_sinks(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._map_sinks(lambda t: t[indices, ...])

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        ring = self.keys.shape[-2] if self.keys is not None and self.keys.dim() == 4 else 0
        first_in_ring = self.cumulative_length - ring
        self._map_sinks(lambda t: t[:, :, :first_in_ring])

    def reset(self) -> None:
        self.sink_keys = self.sink_values = None
        super().reset()

    def offload(self):
        super().offload()
        self._map_sinks(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        super().prefetch()
        if self.is_initialized:
            self._map_sinks(lambda t: t.to(self.device, non_blocking=True))


class DynamicIndexedWindowLayer(PreallocatedIndexedLayer):
    """A full layer's cache with ``exact_window``: its latent entries and index keys (every
    token, as :class:`PreallocatedIndexedLayer`) plus a ring of its own exact keys/values of the
    last ``sliding_window - 1`` tokens (``ring``, a :class:`PreallocatedSlidingWindowLayer`)."""

    def __init__(self, sliding_window: int, **kwargs):
        super().__init__(**kwargs)
        self.sliding_window = sliding_window
        self.ring = PreallocatedSlidingWindowLayer(sliding_window=sliding_window)

    def update_window(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """Exact keys/values [B, H, T, D] of this step -> the ring's rows plus them ([B, H, W', D])."""
        return self.ring.update(key_states, value_states)

    def activate_past_recording(self):
        """Keep the ring's states past the window until the next ``crop`` (assisted decoding)."""
        self.ring.activate_past_recording()

    @property
    def record_past(self) -> bool:
        return self.ring.record_past

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.ring.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self.ring.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self.ring.batch_select_indices(indices)

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        self.ring.crop(tokens_to_remove)

    def reset(self) -> None:
        super().reset()
        self.ring.reset()

    def offload(self):
        super().offload()
        self.ring.offload()

    def prefetch(self):
        super().prefetch()
        self.ring.prefetch()


def _reject_softcap(module: nn.Module, spec: Csa2FullSpec | Csa2ReaderSpec) -> None:
    if getattr(module, "attn_logit_softcapping", None) is not None:
        raise ValueError(f"kind=csa2 mode={spec.mode!r}: attention logit soft-capping is not supported by the sparse read")


class Csa2FullAttention(LatentAttention):
    """``full`` CSA2 layer: MLA entries + index keys cached once; reads Top-K + window."""

    def __init__(self, source: nn.Module, config, layer_idx: int, spec: Csa2FullSpec | dict):
        spec = as_layer_spec(spec, layer_idx, config, Csa2FullSpec)
        _reject_softcap(source, spec)
        super().__init__(source, config, layer_idx, spec)
        self.window, self.top_k = spec.window, spec.top_k
        self.indexer = Indexer(
            source.q_proj.in_features, spec.index_heads, spec.index_head_dim, spec.index_rope_pairs,
            rotary_dim=self.head_dim, with_key=True, dtype=source.q_proj.weight.dtype,
        )
        self.exact_window = spec.exact_window
        if self.exact_window:  # the window is read from the source's own keys/values
            self.k_proj, self.v_proj = source.k_proj, source.v_proj
        self.scratch: dict = {}

    @property
    def cache_width(self) -> int:
        return super().cache_width + self.indexer.head_dim

    def cache_layer_kind(self) -> tuple[type, dict]:
        """The cache layer class (and its arguments) this layer stores its entries in."""
        if self.exact_window:
            return DynamicIndexedWindowLayer, {"sliding_window": self.window}
        return PreallocatedIndexedLayer, {}

    def window_segment(self, hidden_states, position_embeddings, layer, positions, starts=None) -> SparseSegment:
        """The last ``window`` positions read exactly: the source layer's own queries/keys/values
        (QK-norm, RoPE on every dim), keys/values of earlier steps from the cache ``layer``'s ring
        (None: no cache, every position of this forward)."""
        b, t, _ = hidden_states.shape
        shape = (b, t, -1, self.head_dim)
        q, k = self.q_proj(hidden_states).view(shape), self.k_proj(hidden_states).view(shape)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)  # [B, H, T, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q.transpose(1, 2), k.transpose(1, 2), *position_embeddings)
        if layer is not None:
            k, v = layer.update_window(k, v)
        total = int(positions[-1]) + 1
        first = total - k.shape[2]
        own = drop_padding(window_index(positions, self.window, first_position=first).expand(b, -1, -1), starts, first)
        return SparseSegment(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), own)

    def attention_output(self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
        """hidden_states [B, T, hidden] -> ([B, T, HQ*D], None). The read set is built from
        positions (causal) and ``csa2_row_starts`` [B] (left padding; None = unpadded), not from
        ``attention_mask``."""
        b, t, _ = hidden_states.shape
        starts = kwargs.get("csa2_row_starts")
        latent, rope_part = self.compress(hidden_states, position_embeddings)  # [B, 1, T, r], [B, 1, T, X]
        index_keys = self.indexer.keys(hidden_states, position_embeddings)  # [B, T, d_I]
        layer = None
        if cache is not None:
            layer = own_cache_layer(self, cache)
            latent, rope_part = cache.update(latent, rope_part, self.layer_idx)
            index_keys = layer.update_indexer(index_keys)
        s = latent.shape[2]
        positions = torch.arange(s - t, s, device=hidden_states.device)  # [T]
        iq, iw = self.indexer.queries(hidden_states, position_embeddings)
        top = self.indexer.select(iq, iw, index_keys, positions, self.top_k, self.window, starts=starts,
                                  fused=uses_fused_kernels(read_path(self.config), hidden_states.device),
                                  block=self.layer_spec.select_block or 0)  # [B, T, K]
        segments = []
        if self.exact_window:
            segments.append(self.window_segment(hidden_states, position_embeddings, layer, positions, starts))
            index = top
        else:
            index = torch.cat([top, drop_padding(window_index(positions, self.window).expand(b, -1, -1), starts)], dim=-1)

        q_nope, q_rope = self.queries(hidden_states, position_embeddings)
        q, k, latent1, v_up = self.absorbed_operands(q_nope, q_rope, latent, rope_part, layer)
        segments.append(SparseSegment(q.transpose(1, 2), k.transpose(1, 2), latent1.transpose(1, 2), index))
        outs, _ = sparse_sink_attention(segments, scaling=self.scaling, sinks=self.sinks, path=read_path(self.config))
        out = torch.einsum("bthr,hdr->bthd", outs[-1], v_up[self.kv_of_query])  # [B, T, HQ, D]
        if self.exact_window:
            out = out + outs[0]
        self.scratch = {
            "latent": latent, "rope": rope_part, "index_keys": index_keys, "top_k": top,
            "position_embeddings": position_embeddings, "cache_layer": layer,
        }
        return out.reshape(b, t, -1).contiguous(), None


class EntryReader(nn.Module):
    """How a reindex/reuse layer reads a full layer's entries in its own head space.

    Parameters: ``kv_b_proj`` [H * 2D, r_s] (+bias): per own KV head, the key (all ``D`` dims,
    position-free) and value it reads from a source latent; ``q_rope_coef`` [H, m, 2]: complex
    coefficient with which each own KV group reads each of the source's ``m`` rope slots (all
    rope heads' slots, flattened), at that slot's frequency; ``logit_bias`` [HQ]: a per-head
    offset of the entry logits.
    """

    def __init__(self, source_spec: MlaSpec, num_query_heads: int, num_key_value_heads: int, head_dim: int, dtype=None):
        super().__init__()
        self.kv_lora_rank = source_spec.kv_lora_rank
        self.num_key_value_heads, self.head_dim = num_key_value_heads, head_dim
        self.slot_pairs = [i for pairs in source_spec.rope_pairs for i in sorted(pairs)]  # frequency of each slot
        self.num_rope_heads = len(source_spec.rope_pairs)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, num_key_value_heads * 2 * head_dim, bias=True, dtype=dtype)
        self.q_rope_coef = nn.Parameter(torch.zeros(num_key_value_heads, len(self.slot_pairs), 2, dtype=dtype))
        # Per query head, added to every entry logit: approximate keys of far entries spread
        # the logits, which inflates their share; this sets their total mass back.
        self.logit_bias = nn.Parameter(torch.zeros(num_query_heads, dtype=dtype))

    def up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(key map [H, D, r_s+1], value map [H, D, r_s+1]); the bias is the last latent column."""
        h, d, r = self.num_key_value_heads, self.head_dim, self.kv_lora_rank
        w = torch.cat([self.kv_b_proj.weight.view(h, 2 * d, r), self.kv_b_proj.bias.view(h, 2 * d, 1)], dim=-1)
        return w[:, :d], w[:, d:]

    def rope_slots(self, rope_part: torch.Tensor) -> torch.Tensor:
        """The source's cached rope part [B, 1, S, X] -> its rope slots [B, S, 2m] ([re..., im...])."""
        b, _, s, _ = rope_part.shape
        n = len(self.slot_pairs) // self.num_rope_heads
        slots = rope_part[:, 0, :, : 2 * len(self.slot_pairs)].reshape(b, s, self.num_rope_heads, 2, n)
        return slots.transpose(2, 3).reshape(b, s, 2 * len(self.slot_pairs))

    def store_rows(self, latent: torch.Tensor, rope_part: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Rows lo..hi-1 of the store a reader reads: [latent, 1, rope slots] [B, hi-lo, 1, r+1+2m]."""
        latent, rope_part = latent[:, :, lo:hi], rope_part[:, :, lo:hi]
        latent1 = torch.cat([latent[:, 0], latent.new_ones(latent.shape[0], hi - lo, 1)], dim=-1)  # [B, S, r+1]
        return torch.cat([latent1, self.rope_slots(rope_part)], dim=-1)[:, :, None]

    def segment(self, q_plain: torch.Tensor, kv_of_query: torch.Tensor, scratch: dict, index: torch.Tensor,
                scaling: float):
        """Read operands for the source entries.

        q_plain [B, HQ, T, D] (own queries after QK-norm, before RoPE); scratch: the full
        layer's ``latent``/``rope``/``position_embeddings`` of this forward; index [B, T, N].
        Returns (segment, value map per query head [HQ, D, r_s+1]).
        """
        latent, rope_part = scratch["latent"], scratch["rope"]
        b, _, s, _ = latent.shape
        k_up, v_up = self.up_weights()
        q_lat = torch.einsum("bhtd,hdr->bthr", q_plain, k_up[kv_of_query])  # [B, T, HQ, r+1]
        # The constant latent coordinate carries the per-head bias (logits are scaled by `scaling`).
        q_lat = torch.cat([q_lat[..., :-1], q_lat[..., -1:] + (self.logit_bias / scaling).view(1, 1, -1, 1)], dim=-1)
        half = self.head_dim // 2
        pairs = torch.tensor(self.slot_pairs, device=q_plain.device)
        re, im = q_plain[..., pairs], q_plain[..., pairs + half]  # [B, HQ, T, m]
        coef = self.q_rope_coef[kv_of_query][None, :, None]  # [1, HQ, 1, m, 2]
        a, c = coef[..., 0], coef[..., 1]
        q_rope = torch.cat([a * re - c * im, a * im + c * re], dim=-1)  # [B, HQ, T, 2m]
        cos, sin = scratch["position_embeddings"]  # the source's rotary table (Gemma3: per layer type)
        dims = torch.cat([pairs, pairs + half])
        t = q_plain.shape[2]
        cos, sin = cos[:, -t:, dims][:, None], sin[:, -t:, dims][:, None]
        q_rope = (q_rope * cos + rotate_half(q_rope) * sin).transpose(1, 2)  # [B, T, HQ, 2m]
        # Every reader of this full layer reads the same store: built once per forward (in a decode
        # step it is a copy of the whole latent cache, which each reader would otherwise repeat).
        # With a cache the store is kept beside it and grows by this step's rows only.
        key = ("reader_store", tuple(self.slot_pairs), self.num_rope_heads)
        if key not in scratch:
            layer = scratch.get("cache_layer")
            if hasattr(layer, "derived_rows"):
                keys = layer.derived_rows(repr(key), lambda lo, hi: self.store_rows(latent, rope_part, lo, hi), s, dim=1)
            else:
                keys = self.store_rows(latent, rope_part, 0, s)
            scratch[key] = keys, keys[..., : self.kv_lora_rank + 1]  # values: latent1, the first r+1 columns
        keys, values = scratch[key]
        segment = SparseSegment(torch.cat([q_lat, q_rope], dim=-1), keys, values, index)
        return segment, v_up[kv_of_query]


class Csa2ReaderAttention(DenseSinkAttention):
    """``swa`` / ``reindex`` / ``reuse`` CSA2 layer: own exact keys/values of the last
    ``window`` tokens, plus (reindex/reuse) a full layer's entries at Top-K addresses."""

    def __init__(self, source: nn.Module, config, layer_idx: int, spec: Csa2ReaderSpec | dict,
                 entries_spec: Csa2FullSpec | dict | None = None):
        """``entries_spec``: the spec of layer ``spec.entries`` (reindex/reuse), whose entries are read."""
        spec = as_layer_spec(spec, layer_idx, config, Csa2ReaderSpec)
        _reject_softcap(source, spec)
        super().__init__(source, config, layer_idx, spec)
        self.mode, self.window, self.sink_tokens = spec.mode, spec.window, spec.sink_tokens
        dtype = source.q_proj.weight.dtype
        self.reader = None
        if self.mode != "swa":
            entries_spec = as_layer_spec(entries_spec, spec.entries, config, Csa2FullSpec)
            self.reader = EntryReader(entries_spec, self.num_heads, self.num_key_value_heads, self.head_dim, dtype)
        self.indexer = None
        if self.mode == "reindex":
            self.top_k = spec.top_k
            self.indexer = Indexer(
                source.q_proj.in_features, spec.index_heads, spec.index_head_dim, spec.index_rope_pairs,
                rotary_dim=self.head_dim, with_key=False, dtype=dtype,
            )
        self.peers: list[nn.Module] = []  # the model's attention modules, set by the model
        self.scratch: dict = {}

    def _top_k(self, hidden_states: torch.Tensor, positions: torch.Tensor, starts=None) -> torch.Tensor:
        """Top-K addresses [B, T, K] of this layer (reindex: own selection; reuse: its source's,
        minus what falls inside this layer's window)."""
        if self.mode == "reindex":
            full = self.peers[self.layer_spec.entries].scratch
            iq, iw = self.indexer.queries(hidden_states, full["position_embeddings"])
            top = self.indexer.select(iq, iw, full["index_keys"], positions, self.top_k, self.window, starts=starts,
                                      fused=uses_fused_kernels(read_path(self.config), hidden_states.device),
                                      block=self.layer_spec.select_block or 0)
            return top.masked_fill(top < self.sink_tokens, -1)  # held exactly in the own segment
        top = self.peers[self.layer_spec.source].scratch["top_k"]
        inside = top > positions[None, :, None] - self.window
        return top.masked_fill(inside | (top < self.sink_tokens), -1)

    def attention_output(self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
        """hidden_states [B, T, hidden] -> ([B, T, HQ*D], None). The read set is built from
        positions (causal) and ``csa2_row_starts`` [B] (left padding; None = unpadded), not from
        ``attention_mask``."""
        b, t, _ = hidden_states.shape
        segments, v_up = self.read_segments(hidden_states, position_embeddings, cache, kwargs.get("csa2_row_starts"))
        outs, _ = sparse_sink_attention(segments, scaling=self.scaling, sinks=self.sinks, path=read_path(self.config))
        out = outs[0]
        if v_up is not None:
            out = out + torch.einsum("bthr,hdr->bthd", outs[1], v_up)
        return out.reshape(b, t, -1).contiguous(), None

    @torch.no_grad()
    def entry_share(self, hidden_states, position_embeddings) -> torch.Tensor:
        """Share of each query's attention that goes to the shared entries [B, T, HQ] (no cache)."""
        segments, _ = self.read_segments(hidden_states, position_embeddings, None)
        _, weights = sparse_sink_attention(segments, scaling=self.scaling, sinks=self.sinks, return_weights=True,
                                           path=read_path(self.config))
        return weights[..., segments[0].index.shape[-1]:].sum(-1)

    def read_segments(self, hidden_states, position_embeddings, cache=None, starts=None):
        """The segments this layer reads (own window first, then the shared entries) and the
        value map of the entries (or None); ``starts`` [B]: each row's first real position."""
        b, t, _ = hidden_states.shape
        if starts is not None and self.sink_tokens:
            raise ValueError(f"layer {self.layer_idx}: sink_tokens={self.sink_tokens} keeps the first tokens of the "
                             "store, which left padding fills with pads; run padded batches without sink_tokens, or "
                             "batch size 1")
        q_plain, k, v = self.project_plain(hidden_states)  # [B, HQ, T, D], [B, H, T, D]
        cos, sin = position_embeddings
        q = q_plain * cos[:, None] + rotate_half(q_plain) * sin[:, None]
        k = k * cos[:, None] + rotate_half(k) * sin[:, None]
        total, sink_k, sink_v = t, k[:, :, : self.sink_tokens], v[:, :, : self.sink_tokens]
        if cache is not None:
            layer = own_cache_layer(self, cache)
            k, v = cache.update(k, v, self.layer_idx)
            total = layer.get_seq_length()
            if self.sink_tokens:
                sink_k, sink_v = (k[:, :, :0], v[:, :, :0]) if layer.sink_keys is None else (layer.sink_keys, layer.sink_values)
        positions = torch.arange(total - t, total, device=hidden_states.device)
        own = window_index(positions, self.window, first_position=total - k.shape[2]).expand(b, -1, -1)
        own = drop_padding(own, starts, total - k.shape[2])
        if self.sink_tokens:
            # The first tokens, once they have left the window: rows 0..P-1 of [sinks; window].
            first = torch.arange(sink_k.shape[2], device=own.device)
            sink_index = torch.where(first[None, :] <= positions[:, None] - self.window, first[None, :], -1)
            own = torch.cat([sink_index.expand(b, -1, -1), own.masked_fill(own < 0, -1 - sink_k.shape[2]) + sink_k.shape[2]], -1)
            k, v = torch.cat([sink_k, k], dim=2), torch.cat([sink_v, v], dim=2)
        segments = [SparseSegment(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), own)]
        v_up = None
        if self.reader is not None:
            top = self._top_k(hidden_states, positions, starts)
            entries, v_up = self.reader.segment(q_plain, self.kv_of_query, self.peers[self.layer_spec.entries].scratch, top,
                                                self.scaling)
            segments.append(entries)
            self.scratch = {"top_k": top}
        return segments, v_up

    def cache_layer_kind(self) -> tuple[type, dict]:
        """The cache layer class (and its arguments) of this layer's own window."""
        if self.sink_tokens:
            return DynamicSinkWindowLayer, {"sliding_window": self.window, "sink_tokens": self.sink_tokens}
        return PreallocatedSlidingWindowLayer, {"sliding_window": self.window}

    @property
    def kv_of_query(self) -> torch.Tensor:
        return torch.arange(self.num_heads, device=self.q_proj.weight.device) // self.num_key_value_groups


__all__ = ["Csa2FullAttention", "Csa2ReaderAttention", "DynamicIndexedWindowLayer", "DynamicSinkWindowLayer", "EntryReader", "cache_layer"]
