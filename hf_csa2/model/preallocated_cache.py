"""Cache layers that append in place instead of concatenating (issue "Kernels and fast paths", CPU path).

transformers' ``DynamicLayer`` grows by ``torch.cat`` on every step: decoding one token copies the
whole cache of the layer (and its sliding-window layers copy their whole window). At batch 8 and
4K tokens that copy is most of a CSA2 decode step's memory traffic. The layers here keep a store
with spare rows behind the held tensor, write a step's rows into it, and hand out views:

* :class:`PreallocatedLayer` / :class:`PreallocatedIndexedLayer` -- every token kept (latent
  entries, index keys); a full store is reallocated with ``1/8`` more rows than it holds
  (at least :data:`MIN_SPARE_ROWS`), so a decode step copies O(1) rows on average;
  They also keep rows derived from theirs (:meth:`PreallocatedLayer.derived_rows`: the absorbed
  keys an MLA or CSA2 full layer reads, the store CSA2 readers read), grown the same way;
* :class:`PreallocatedSlidingWindowLayer` -- the last ``sliding_window - 1`` tokens; its store
  holds the window plus ``window / 4`` spare rows (at least :data:`MIN_SPARE_ROWS`), and when
  they run out the window moves to a fresh store.

What they hold and return is equal, element for element, to their transformers parents', and
the cache metrics count the held tensors, not the stores (``store_attributes``). Anything that
replaces the held tensor (beam reorder, batch select, offload) simply makes the next step start a
new store. Under autograd, where an in-place write into a tensor an earlier step saved would break
backward, they concatenate like their parents.

Self-contained (torch + transformers only): copied next to converted weights.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicIndexedLayer, DynamicLayer, DynamicSlidingWindowLayer

MIN_SPARE_ROWS = 64


def _offset_in_store(store: torch.Tensor | None, held: torch.Tensor, dim: int) -> int | None:
    """The row of ``store`` (along ``dim``) where ``held`` starts, when ``held`` is a run of its
    rows (a view of it, same layout); else None."""
    if store is None or held.dim() != store.dim() or held.dtype != store.dtype or held.device != store.device:
        return None
    dim %= store.dim()
    if held.stride() != store.stride() or any(held.shape[i] != store.shape[i] for i in range(store.dim()) if i != dim):
        return None
    step = store.stride(dim) * store.element_size()
    delta = held.data_ptr() - store.data_ptr()
    if delta < 0 or delta % step:
        return None
    offset = delta // step
    return offset if offset + held.shape[dim] <= store.shape[dim] else None


def _new_store(like: torch.Tensor, rows: int, dim: int) -> torch.Tensor:
    shape = list(like.shape)
    shape[dim] = rows
    return like.new_empty(shape)


def append_rows(store: torch.Tensor | None, held: torch.Tensor | None, new: torch.Tensor, dim: int,
                keep: int | None = None) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``held`` followed by ``new`` along ``dim``, written into ``store``'s spare rows when it has them.

    Args:
        store: the buffer ``held`` lives in (None: none yet).
        held: the rows held so far (None, or a tensor of another rank: nothing yet).
        new: this step's rows.
        dim: the sequence dimension.
        keep: hold only the last ``keep`` rows afterwards (a sliding window); None = all.

    Returns:
        (store, full = held ++ new, what to hold next: ``full`` or its last ``keep`` rows). ``full``
        is a view of ``store`` when the rows fit; the rows it shows are never written again while
        they are held.
    """
    if held is None or held.dim() != new.dim():
        held = new.narrow(dim, 0, 0)
    n, t = held.shape[dim], new.shape[dim]
    if torch.is_grad_enabled() and (held.requires_grad or new.requires_grad):
        full = torch.cat([held, new], dim=dim)
        return None, full, full if keep is None else full.narrow(dim, max(0, n + t - keep), min(n + t, keep))
    offset = _offset_in_store(store, held, dim) if n else None
    if offset is None or offset + n + t > store.shape[dim]:
        if keep is None:
            total = n + t
            store = _new_store(new, total + max(MIN_SPARE_ROWS, total // 8), dim)
            store.narrow(dim, 0, n).copy_(held)
            offset = 0
        else:
            # A window moves to a new store that holds only its last rows (a long prefill's rows are
            # returned, not kept), so a store never holds more than the window and its spare rows.
            full = torch.cat([held, new], dim=dim)
            kept = min(n + t, keep)
            store = _new_store(new, kept + max(MIN_SPARE_ROWS, keep // 4), dim)
            store.narrow(dim, 0, kept).copy_(full.narrow(dim, n + t - kept, kept))
            return store, full, store.narrow(dim, 0, kept)
    store.narrow(dim, offset + n, t).copy_(new)
    full = store.narrow(dim, offset, n + t)
    return store, full, full if keep is None else full.narrow(dim, max(0, n + t - keep), min(n + t, keep))


class PreallocatedLayer(DynamicLayer):
    """:class:`~transformers.cache_utils.DynamicLayer` appending in place (see the module doc)."""

    key_store = value_store = None
    store_attributes = ("key_store", "value_store")  # capacity, not entries: the cache metrics skip them

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.key_store, self.keys, _ = append_rows(self.key_store, self.keys, key_states, -2)
        self.value_store, self.values, _ = append_rows(self.value_store, self.values, value_states, -2)
        return self.keys, self.values

    def derived_rows(self, name: str, rows_of, total: int, dim: int = -2) -> torch.Tensor:
        """A tensor computed row by row from this layer's rows (e.g. an MLA layer's absorbed keys
        ``[latent, 1, rope]``), kept beside them so that a step computes only its own rows.

        Args:
            name: what is derived (one entry per name).
            rows_of: ``rows_of(lo, hi)`` -> the derived rows of cached rows ``lo..hi-1``.
            total: rows the layer holds now.
            dim: the sequence dimension of the derived tensor.

        Returns the derived rows of all ``total`` rows. Anything that reorders, selects or crops
        the cache drops what was kept (:meth:`forget_derived`).
        """
        kept = self.__dict__.setdefault("derived", {})
        store, held = kept.get(name, (None, None))
        done = 0 if held is None or held.shape[dim] > total else held.shape[dim]
        if done == 0:
            store = held = None
        store, held, _ = append_rows(store, held, rows_of(done, total), dim)
        kept[name] = (store, held)
        return held

    def forget_derived(self) -> None:
        self.__dict__.pop("derived", None)

    def reset(self) -> None:
        self.key_store = self.value_store = None
        self.forget_derived()
        super().reset()

    def offload(self):
        self.key_store = self.value_store = None
        self.forget_derived()
        super().offload()

    def crop(self, tokens_to_remove: int) -> None:
        self.forget_derived()
        super().crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.forget_derived()
        super().reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.forget_derived()
        super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.forget_derived()
        super().batch_select_indices(indices)


class PreallocatedIndexedLayer(PreallocatedLayer, DynamicIndexedLayer):
    """:class:`~transformers.cache_utils.DynamicIndexedLayer` (a full CSA2 layer's latent entries and
    index keys ``[B, S, d_I]``) appending in place."""

    indexer_store = None
    store_attributes = ("key_store", "value_store", "indexer_store")

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        if not self.is_indexer_initialized:
            self.lazy_initialization_indexer(indexer_key_states)
        self.indexer_store, self.indexer_keys, _ = append_rows(self.indexer_store, self.indexer_keys,
                                                               indexer_key_states, 1)
        return self.indexer_keys

    def reset(self) -> None:
        self.indexer_store = None
        super().reset()

    def offload(self):
        self.indexer_store = None
        super().offload()


class PreallocatedSlidingWindowLayer(DynamicSlidingWindowLayer):
    """:class:`~transformers.cache_utils.DynamicSlidingWindowLayer` appending in place: holds the
    last ``sliding_window - 1`` tokens ``[B, H, <=W-1, D]``, returns them with this step's."""

    key_store = value_store = None
    store_attributes = ("key_store", "value_store")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.record_past or self.sliding_window < 2:  # assisted decoding keeps the past: the parent's path
            return super().update(key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        keep = self.sliding_window - 1
        self.key_store, full_keys, self.keys = append_rows(self.key_store, self.keys, key_states, -2, keep)
        self.value_store, full_values, self.values = append_rows(self.value_store, self.values, value_states, -2, keep)
        return full_keys, full_values

    def reset(self) -> None:
        self.key_store = self.value_store = None
        super().reset()

    def offload(self):
        self.key_store = self.value_store = None
        super().offload()


def cache_layer(cache, layer_idx: int, layer_type: type, *, required: bool = True, **kwargs):
    """The cache layer of ``layer_idx``, replaced by a fresh ``layer_type(**kwargs)`` when the
    cache was built without knowing this layer's needs (it must still be empty then). With
    ``required=False`` (a layer that runs on any cache layer, only slower) a layer that cannot be
    replaced (holding tokens, or not a dynamic one: static, quantized) is returned as it is."""
    layers = cache.layers
    while len(layers) <= layer_idx:
        layers.append(DynamicLayer())
    layer = layers[layer_idx]
    if type(layer) is layer_type and all(getattr(layer, k, None) == v for k, v in kwargs.items()):
        return layer
    holding = getattr(layer, "is_initialized", False) and layer.get_seq_length() > 0
    if holding or not isinstance(layer, DynamicLayer):
        if not required:
            return layer
        if holding:
            raise ValueError(f"cache layer {layer_idx} is a {type(layer).__name__} holding tokens; this layer needs "
                             f"{layer_type.__name__}{kwargs or ''} (use a DynamicCache)")
        raise ValueError(f"layer {layer_idx} needs a dynamic cache (DynamicCache); cache layer {layer_idx} is "
                         f"{type(layer).__name__}")
    layer = layers[layer_idx] = layer_type(**kwargs)
    return layer


def own_cache_layer(attn: torch.nn.Module, cache, *, required: bool = True):
    """The cache layer of an attention module, of the class its ``cache_layer_kind()`` names."""
    layer_type, kwargs = attn.cache_layer_kind()
    return cache_layer(cache, attn.layer_idx, layer_type, required=required, **kwargs)
