"""Rebuilding a model with new per-layer attention specs, carrying its weights over."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from ..model import Csa2Config, Csa2ForCausalLM


def is_csa2(model) -> bool:
    return isinstance(model.config, Csa2Config)


def to_csa2(model: PreTrainedModel, attention_layers: list[dict], state: dict | None = None) -> Csa2ForCausalLM:
    """Rebuild ``model`` (native or hf_csa2) as a Csa2ForCausalLM with new per-layer specs,
    loading ``state`` (default: the model's own state dict); parameters it lacks, such as
    new sinks, keep their init."""
    base_cfg = model.config.to_base_config() if is_csa2(model) else model.config
    config = Csa2Config.from_base_config(base_cfg, attention_layers)
    config._attn_implementation = model.config._attn_implementation or "sdpa"
    new = Csa2ForCausalLM(config).to(model.dtype)
    load_matching(new, model.state_dict() if state is None else state)
    new.generation_config = model.generation_config
    return new.eval()


def to_native(model: Csa2ForCausalLM) -> PreTrainedModel:
    """The source architecture's own model class, when the specs need nothing of ours."""
    if not model.config.uses_only_native_features:
        raise ValueError("this model uses hf_csa2 features (sinks or per-layer KV heads); it cannot be native")
    base_cfg = model.config.to_base_config()
    base_cfg.num_key_value_heads = model.config.attention_layers[0]["num_key_value_heads"]
    native = MODEL_FOR_CAUSAL_LM_MAPPING[type(base_cfg)](base_cfg).to(model.dtype)
    load_matching(native, model.state_dict(), strict=True)
    native.generation_config = model.generation_config
    return native.eval()


def load_matching(model: torch.nn.Module, state: dict, strict: bool = False) -> None:
    """Load the entries of ``state`` that ``model`` has; shapes must match."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    if strict and missing:
        raise RuntimeError(f"weights missing for {missing[:5]}")
    bad = [k for k in own if k in state and own[k].shape != state[k].shape]
    if bad:
        raise RuntimeError(f"shape mismatch for {bad[:5]}")
    model.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)


def native_specs(config) -> list[dict]:
    """Per-layer specs describing a native (source-architecture) config."""
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return [{"kind": "dense", "num_key_value_heads": kv, "sinks": False} for _ in range(config.num_hidden_layers)]


__all__ = ["is_csa2", "load_matching", "native_specs", "to_csa2", "to_native"]


