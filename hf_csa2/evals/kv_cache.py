"""KV-cache accounting: what a model's config says it stores per token, and what a live
cache object actually holds after a prefill (the two must agree)."""

from __future__ import annotations

import torch


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


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
        sliding = layer_type == "sliding_attention" or (window is not None and getattr(config, "model_type", "") == "mistral")
        out.append({**spec, "window": window if sliding else None})
    return out


def config_kv_elements_per_token(config) -> int:
    """Cache elements one token adds (K and V of every layer), from the config alone.

    Sliding-window layers are counted too: they hold every token while it is in the window,
    which is what a prefill shorter than the window measures.
    """
    d = _head_dim(config)
    return sum(2 * spec["num_key_value_heads"] * d for spec in layer_attention_specs(config))


def live_cache_elements(cache) -> int:
    """Total elements of all tensors held by a transformers Cache object (per layer)."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for value in vars(layer).values():
            if isinstance(value, torch.Tensor) and value.dim() > 1:
                total += value.numel()
    return total


@torch.no_grad()
def measure_kv_elements_per_token(model, num_tokens: int = 16) -> float:
    """Run a short prefill (batch 1) and divide the live cache's elements by ``num_tokens``."""
    ids = torch.arange(num_tokens, device=next(model.parameters()).device)[None] % model.config.vocab_size
    out = model(input_ids=ids, use_cache=True)
    return live_cache_elements(out.cache) / num_tokens


__all__ = ["config_kv_elements_per_token", "layer_attention_specs", "live_cache_elements", "measure_kv_elements_per_token"]
