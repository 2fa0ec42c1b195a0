"""The bytes one decode step must read, a lower bound on its time (issue "Kernels" item 5).

A decode step at batch 1 is bound by memory traffic, not arithmetic: every weight matrix is
read once per step (the input embedding only one row), and every attention layer reads what
its query may attend to from the cache. Per layer, with ``L`` tokens visible to the query
(the cached ones and itself):

* dense: its ``2 H D`` keys/values of ``L`` tokens (of ``min(L, window)`` when sliding);
* lowrank: its key and value codes of those tokens;
* MLA: its latent + rope keys (+ QK-norm key scales) of ``L`` tokens (absorbed decode reads
  the latent, not per-head keys);
* CSA2 ``full``: the index keys of all ``L`` tokens (the indexer scores every one) and the
  entries it reads: its window + Top-K (with ``exact_window`` the window from its exact ring);
* CSA2 ``swa``: its own window (+ the first ``sink_tokens``);
* ``reuse``: its own window and the entries its source picked, outside its own window;
* ``reindex``: that, plus the index keys of all ``L`` tokens (its own index queries score them).

The bound counts each read once and ignores activations, so a measured step can approach it but
never beat it; ``bytes / bandwidth`` over the measured time is how close an implementation gets.
"""

from __future__ import annotations

import statistics
import time
from typing import NamedTuple

import torch

from hf_csa2.model.configuration_hf_csa2 import QK_NORM_BASE_MODEL_TYPES, attention_head_dim

from .kv_cache import layer_attention_specs, layer_kv_elements_per_token


def _seen(context: int, window: int | None, sink_tokens: int = 0) -> int:
    """Tokens a windowed read covers at ``context`` visible tokens."""
    if not window:
        return context
    return min(context, window) + min(sink_tokens, max(0, context - window))


def _picks(context: int, top_k: int, *windows: int) -> int:
    """Top-K entries read: picks come from positions older than every window involved."""
    return min(top_k, max(0, context - max(windows)))


class LayerReads(NamedTuple):
    """What one layer reads for one query: tokens of its own exact keys/values, latent entries
    (its own or a full layer's) and index keys."""

    own: int
    entries: int
    index_keys: int


def layer_reads(specs: list[dict], i: int, context: int) -> LayerReads:
    """What layer ``i`` reads for one query with ``context`` visible tokens.

    ``specs`` are :func:`~hf_csa2.metrics.kv_cache.layer_attention_specs` of the whole model
    (reuse/reindex layers read other layers' entries and picks).
    """
    spec = specs[i]
    if spec["kind"] in ("dense", "lowrank"):
        return LayerReads(_seen(context, spec["window"]), 0, 0)
    if spec["kind"] == "mla":
        return LayerReads(0, _seen(context, spec["window"]), 0)
    w = spec["read_window"]
    if spec["mode"] == "full":
        if spec.get("ring"):
            return LayerReads(_seen(context, w), _picks(context, spec["top_k"], w), context)
        return LayerReads(0, min(context, w + spec["top_k"]), context)
    own = _seen(context, w, spec.get("sink_tokens", 0))
    if spec["mode"] == "swa":
        return LayerReads(own, 0, 0)
    if spec["mode"] == "reindex":
        return LayerReads(own, _picks(context, spec["top_k"], w), context)
    selector = specs[spec["source"]]  # a full or reindex layer: its picks are reused
    return LayerReads(own, _picks(context, selector["top_k"], selector["read_window"], w), 0)


def layer_read_elements(specs: list[dict], i: int, head_dim: int, qk_norm: bool, context: int) -> int:
    """Cache elements layer ``i`` reads for one query with ``context`` visible tokens."""
    spec = specs[i]
    reads = layer_reads(specs, i, context)
    own = 2 * spec.get("num_key_value_heads", 1) * head_dim  # exact keys + values of one token
    if spec["kind"] in ("dense", "lowrank"):
        own = layer_kv_elements_per_token(spec, head_dim, qk_norm)
    entries = specs[spec["entries"]] if spec.get("entries") is not None else spec
    entry = layer_kv_elements_per_token({**entries, "index_head_dim": 0}, head_dim, qk_norm) if reads.entries else 0
    return reads.own * own + reads.entries * entry + reads.index_keys * (entries.get("index_head_dim") or 0)


def decode_read_elements(config, context: int) -> int:
    """Cache elements all layers read for one decoded token with ``context`` visible tokens."""
    specs = layer_attention_specs(config)
    d = attention_head_dim(config)
    arch = getattr(config, "base_model_type", None) or config.model_type
    qk_norm = arch in QK_NORM_BASE_MODEL_TYPES
    return sum(layer_read_elements(specs, i, d, qk_norm, context) for i in range(len(specs)))


def weight_read_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter once (tied embeddings once, as
    the output head), an untied input embedding only one row per token."""
    inp = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    tied = out is not None and out.weight.data_ptr() == inp.data_ptr()
    total = 0
    seen = set()
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if p.data_ptr() == inp.data_ptr() and not tied:
            total += inp.shape[1] * inp.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


def decode_read_bytes(model, context: int, batch: int = 1) -> int:
    """Lower bound of the bytes one decode step reads: weights once, the cache reads per row."""
    dtype_size = next(model.parameters()).element_size()
    return weight_read_bytes(model) + batch * decode_read_elements(model.config, context) * dtype_size


def measure_read_bandwidth(num_bytes: int = 2**26, repeats: int = 5, device="cpu") -> float:
    """Bytes per second this process reads from memory: the median time of summing a buffer of
    ``num_bytes`` (larger than any cache level), the same reads a decode step's matmuls make."""
    buf = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        buf.sum()
        if buf.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return num_bytes / statistics.median(times[1:])  # the first pass pays page faults


__all__ = ["LayerReads", "decode_read_bytes", "decode_read_elements", "layer_read_elements", "layer_reads", "measure_read_bandwidth",
           "weight_read_bytes"]
