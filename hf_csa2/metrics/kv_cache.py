"""KV-cache accounting: what a model's config says it stores per token, and what a live
cache object actually holds after a prefill (the two must agree)."""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from hf_csa2.model.configuration_hf_csa2 import (
    QK_NORM_BASE_MODEL_TYPES as QK_NORM_MODEL_TYPES,
)
from hf_csa2.model.configuration_hf_csa2 import attention_head_dim


def layer_attention_specs(config) -> list[dict]:
    """Per-layer attention description: ``{"kind", "num_key_value_heads", "sinks", "window"}``.

    Works for native source configs and for ``hf_csa2`` configs.
    """
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    specs = getattr(config, "attention_layers", None)
    if specs is None:
        kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        specs = [{"kind": "dense", "num_key_value_heads": kv, "sinks": False}] * config.num_hidden_layers
    out = []
    for spec, layer_type in zip(specs, layer_types):
        arch = getattr(config, "base_model_type", None) or config.model_type
        # Mistral has no layer_types: its one sliding_window applies to every layer.
        sliding = layer_type == "sliding_attention" or (window is not None and arch == "mistral")
        if spec.get("kind") == "csa2":  # own window ring; full layers keep every entry
            full = spec["mode"] == "full"
            # a full layer with exact_window keeps a ring of its own exact keys/values besides
            ring = spec["window"] if full and spec.get("exact_window") else None
            out.append({**spec, "window": None if full else spec["window"], "read_window": spec["window"], "ring": ring})
            continue
        out.append({**spec, "window": window if sliding else None})
    return out


def layer_kv_elements_per_token(spec: dict, head_dim: int, qk_norm: bool = False) -> int:
    """Cache elements one token adds to one layer: ``2 * H * D`` for dense attention; for MLA
    the latent plus the rope keys (``kv_lora_rank + R * 2n``), plus one key scale per KV head
    for QK-norm sources; a CSA2 full layer adds its index key, CSA2 window layers hold their own
    ``2 * H * D`` while the token is in their window; a lowrank layer its key and value codes."""
    if spec["kind"] == "lowrank":
        return spec["key_rank"] + spec["value_rank"]
    if spec["kind"] == "mla" or spec.get("mode") == "full":
        rope = sum(2 * len(p) for p in spec["rope_pairs"])
        index_key = spec.get("index_head_dim", 0)  # CSA2 full layers also cache one index key
        return spec["kv_lora_rank"] + rope + (spec["num_key_value_heads"] if qk_norm else 0) + index_key
    return 2 * spec["num_key_value_heads"] * head_dim


def ring_elements(spec: dict, head_dim: int, num_tokens: int) -> int:
    """Elements of a CSA2 full layer's exact-window ring after ``num_tokens`` tokens (0 without one):
    its own ``2 * H * D`` per token of the last ``window - 1``."""
    if not spec.get("ring"):
        return 0
    return min(num_tokens, spec["ring"] - 1) * 2 * spec["num_key_value_heads"] * head_dim


def config_kv_elements_per_token(config) -> int:
    """Cache elements one token adds (all layers), from the config alone.

    Sliding-window layers (and the exact-window rings of CSA2 full layers) are counted too:
    they hold every token while it is in the window, which is what a prefill shorter than the
    window measures.
    """
    d = attention_head_dim(config)
    arch = getattr(config, "base_model_type", None) or config.model_type
    qk_norm = arch in QK_NORM_MODEL_TYPES
    return sum(layer_kv_elements_per_token(spec, d, qk_norm) + ring_elements(spec, d, 1)
               for spec in layer_attention_specs(config))


def described_layers(config) -> list[dict]:
    """:func:`layer_attention_specs` with each layer's ``kv_elements_per_token``."""
    d = attention_head_dim(config)
    qk_norm = (getattr(config, "base_model_type", None) or config.model_type) in QK_NORM_MODEL_TYPES
    return [{**spec, "kv_elements_per_token": layer_kv_elements_per_token(spec, d, qk_norm)}
            for spec in layer_attention_specs(config)]


def format_layer_table(layers: list[dict]) -> str:
    """Markdown table of :func:`described_layers`: one row per run of consecutive layers that are
    alike (kind, KV heads, latent rank, rope key width, sinks, window, KV elements per token;
    e.g. ``0-29`` for a model converted to MQA throughout)."""
    lines = ["| layer | kind | kv heads | latent | rope key | sinks | window | KV elements/token |",
             "|---:|---|---:|---:|---:|---|---:|---:|"]
    rows: list[tuple[int, int, str]] = []  # (first layer, last layer, the row's cells after the layer)
    for i, s in enumerate(layers):
        latent = s.get("kv_lora_rank", "-")
        rope = sum(2 * len(p) for p in s["rope_pairs"]) if "rope_pairs" in s else "-"
        kind = s["kind"] if s["kind"] != "csa2" else f"csa2 {s['mode']}" + (f" <- {s['source']}" if "source" in s else "")
        if "top_k" in s:
            kind += f" (top-{s['top_k']}, window {s['read_window']})"
        cells = (f"{kind} | {s['num_key_value_heads']} | {latent} | {rope} | {s.get('sinks', False)} | "
                 f"{s['window'] or '-'}{' + first ' + str(s['sink_tokens']) if s.get('sink_tokens') else ''} | "
                 f"{s['kv_elements_per_token']} |")
        if rows and rows[-1][2] == cells:
            rows[-1] = (rows[-1][0], i, cells)
        else:
            rows.append((i, i, cells))
    lines += [f"| {lo if lo == hi else f'{lo}-{hi}'} | {cells}" for lo, hi, cells in rows]
    return "\n".join(lines)


def config_kv_elements_at_context(config, num_tokens: int) -> int:
    """Cache elements held (all layers) after ``num_tokens`` tokens, from the config alone:
    a layer with a window keeps its last ``window - 1`` tokens (transformers' sliding cache
    layers; the newest token joins at read time) plus its first ``sink_tokens`` once they left
    the window (CSA2 window layers), every other layer keeps them all (a CSA2 full layer with
    ``exact_window`` also its ring of the last ``window - 1``)."""
    d = attention_head_dim(config)
    arch = getattr(config, "base_model_type", None) or config.model_type
    qk_norm = arch in QK_NORM_MODEL_TYPES
    total = 0
    for spec in layer_attention_specs(config):
        held = num_tokens if not spec["window"] else min(num_tokens, spec["window"] - 1 + spec.get("sink_tokens", 0))
        total += held * layer_kv_elements_per_token(spec, d, qk_norm) + ring_elements(spec, d, num_tokens)
    return total


def cache_tensors(cache):
    """Every tensor (dim > 1) held by the layers of a transformers Cache object (not the stores
    the held tensors are views of: their spare rows hold no token)."""
    for layer in getattr(cache, "layers", []):
        yield from _layer_tensors(layer)


def _layer_tensors(layer):
    # Spare rows behind the held tensors (hf_csa2.model.preallocated_cache) are capacity, not entries.
    stores = getattr(layer, "store_attributes", ())
    for name, value in vars(layer).items():
        if name in stores:
            continue
        if isinstance(value, torch.Tensor) and value.dim() > 1:
            yield value
        elif isinstance(value, CacheLayerMixin):  # a cache layer inside another (a full layer's exact-window ring)
            yield from _layer_tensors(value)


def live_cache_elements(cache) -> int:
    """Total elements of all tensors held by a transformers Cache object (per layer)."""
    return sum(t.numel() for t in cache_tensors(cache))


def live_cache_bytes(cache) -> int:
    """Total bytes of all tensors held by a transformers Cache object."""
    return sum(t.numel() * t.element_size() for t in cache_tensors(cache))


def shortest_window(config) -> int | None:
    windows = [w for s in layer_attention_specs(config) for w in (s["window"], s.get("ring")) if w]
    return min(windows) if windows else None


def measurement_length(config, num_tokens: int = 16) -> int:
    """Prefill length for :func:`measure_kv_elements_per_token`: at most ``num_tokens`` and
    short enough that sliding-window caches (which keep ``window - 1`` tokens) hold them all."""
    window = shortest_window(config)
    return max(1, min(num_tokens, window - 1)) if window else num_tokens


@torch.no_grad()
def measure_kv_elements_per_token(model, num_tokens: int = 16) -> float:
    """Run a short prefill (batch 1) and divide the live cache's elements by its length.

    The length is ``measurement_length(config, num_tokens)`` so that every layer still holds
    every token; the result is then comparable with :func:`config_kv_elements_per_token`.
    """
    num_tokens = measurement_length(model.config, num_tokens)
    ids = torch.arange(num_tokens, device=next(model.parameters()).device)[None] % model.config.vocab_size
    out = model(input_ids=ids, use_cache=True)
    return live_cache_elements(out.cache) / num_tokens


@torch.no_grad()
def measure_kv_elements_at_context(model, num_tokens: int) -> float:
    """Live-cache elements per token after a ``num_tokens`` prefill (batch 1): what a model
    with windowed layers really holds per token of context."""
    ids = torch.arange(num_tokens, device=next(model.parameters()).device)[None] % model.config.vocab_size
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    return live_cache_elements(out.cache) / num_tokens


def saturation_length(config, context: int) -> int:
    """Shortest prefill after which every windowed layer already holds what it holds after
    ``context`` tokens (0 when no window is shorter than ``context``): beyond it the live
    cache grows by the same number of elements per token."""
    specs = layer_attention_specs(config)
    held = [spec["window"] - 1 + spec.get("sink_tokens", 0) for spec in specs if spec["window"]]
    held += [spec["ring"] - 1 for spec in specs if spec.get("ring")]
    held = [h for h in held if h < context]
    return max(held) + 1 if held else 0


@torch.no_grad()
def measure_kv_elements_per_token_at(model, context: int, step: int = 8) -> float:
    """Live-cache elements per token after a ``context``-token prefill, without running one.

    Past :func:`saturation_length` the cache is an affine function of the length, so two short
    prefills (``n`` and ``n + step`` tokens, ``n`` just past the longest window) give it exactly
    at ``context``; shorter contexts are measured directly.
    """
    n1 = max(saturation_length(model.config, context), 1)
    if n1 + step >= context:
        return measure_kv_elements_at_context(model, context)
    e1 = measure_kv_elements_at_context(model, n1) * n1
    e2 = measure_kv_elements_at_context(model, n1 + step) * (n1 + step)
    return (e1 + (context - n1) * (e2 - e1) / step) / context


__all__ = ["cache_tensors", "described_layers", "format_layer_table", "config_kv_elements_at_context", "config_kv_elements_per_token", "layer_kv_elements_per_token", "live_cache_bytes", "measurement_length", "layer_attention_specs", "live_cache_elements", "measure_kv_elements_at_context", "measure_kv_elements_per_token", "measure_kv_elements_per_token_at", "saturation_length"]
