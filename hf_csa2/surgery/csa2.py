"""CSA2 layout: turn a model into shared-KV sparse layers (seed 000).

``full`` layers come from the MLA form of the same layer (its latent entries become the
shared entries); ``reindex`` / ``reuse`` / ``swa`` layers keep their own dense keys/values for
their window and get an entry reader (and, for reindex, an index query) whose weights start
at their init. Calibrated initialisation of readers and indexers builds on this layout.
"""

from __future__ import annotations

from ..model import Csa2ForCausalLM
from ..model.configuration_hf_csa2 import CSA2_MODES
from .rebuild import is_csa2, native_specs, to_csa2


def csa2_layer_specs(
    mla_specs: list[dict],
    dense_specs: list[dict],
    modes: list[str],
    sources: list[int | None],
    *,
    window: int,
    top_k: int,
    index_heads: int,
    index_head_dim: int,
    index_rope_pairs: list[int] | None = None,
    sinks: bool | None = None,
) -> list[dict]:
    """Per-layer ``kind: csa2`` specs.

    mla_specs: the MLA spec of each layer (used by ``full`` layers); dense_specs: the dense spec
    of each layer (``num_key_value_heads``/``sinks`` of the window); modes/sources: the layer plan
    (source = None for full/swa). ``sinks=None`` keeps each layer's own setting.
    """
    n = len(modes)
    if not (len(mla_specs) == len(dense_specs) == len(sources) == n):
        raise ValueError(f"one mode and one source per layer: got {len(modes)} modes, {len(sources)} sources for {len(mla_specs)} layers")
    specs = []
    for i, (mode, src) in enumerate(zip(modes, sources)):
        if mode not in CSA2_MODES:
            raise ValueError(f"layer {i}: mode={mode!r}; allowed: {', '.join(CSA2_MODES)}")
        base = mla_specs[i] if mode == "full" else dense_specs[i]
        spec = {"kind": "csa2", "mode": mode, "window": window,
                "num_key_value_heads": base["num_key_value_heads"],
                "sinks": base.get("sinks", False) if sinks is None else sinks}
        if mode == "full":
            spec.update(kv_lora_rank=base["kv_lora_rank"], rope_pairs=base["rope_pairs"],
                        latent_norm=base.get("latent_norm", False), index_head_dim=index_head_dim,
                        index_rope_pairs=list(index_rope_pairs or []))
        if mode in ("full", "reindex"):
            spec.update(top_k=top_k, index_heads=index_heads)
        if mode in ("reindex", "reuse"):
            spec["source"] = src
        specs.append(spec)
    return specs


def assemble_csa2(dense_model, mla_model, specs: list[dict]) -> Csa2ForCausalLM:
    """Build the CSA2 model: full layers take ``mla_model``'s attention weights, every other
    layer ``dense_model``'s (its own exact K/V for the window); embeddings, MLPs and norms come
    from ``dense_model``. New parameters (indexers, readers) keep their init."""
    state = dict(dense_model.state_dict())
    mla_state = mla_model.state_dict()
    for i, spec in enumerate(specs):
        prefix = f"model.layers.{i}.self_attn."
        if spec["mode"] == "full":
            state = {k: v for k, v in state.items() if not k.startswith(prefix)}
            state.update({k: v for k, v in mla_state.items() if k.startswith(prefix)})
    return to_csa2(dense_model, specs, state)


def dense_layer_specs(model) -> list[dict]:
    """Per-layer dense specs of a native or hf_csa2 model."""
    return [dict(s) for s in model.config.attention_layers] if is_csa2(model) else native_specs(model.config)


__all__ = ["assemble_csa2", "csa2_layer_specs", "dense_layer_specs"]
