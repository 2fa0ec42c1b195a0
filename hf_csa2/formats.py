"""What a checkpoint must be to be saved in another architecture's stock format, checked without
converting anything: :func:`export_problems` lists what keeps a model from DeepSeek-V3 (the
export itself is :mod:`hf_csa2.export.deepseek_v3`). Low in the layers so that training can keep a
student exportable (:func:`hf_csa2.engine.trainer.layout_zeros`)."""

from __future__ import annotations

from .model import Csa2ForCausalLM

EXPORTABLE_BASES = ("llama", "mistral", "qwen2")


def export_problems(model) -> list[str]:
    """Everything that keeps ``model`` from the DeepSeek-V3 format (empty list = exportable)."""
    cfg = model.config
    if not isinstance(model, Csa2ForCausalLM):
        return [f"not an hf_csa2 model ({type(model).__name__}); convert it with an MLA plan first"]
    problems = []
    if cfg.base_model_type not in EXPORTABLE_BASES:
        problems.append(f"source architecture {cfg.base_model_type!r} (allowed: {', '.join(EXPORTABLE_BASES)}; "
                        "QK-norm, sliding/global layers and Gemma norms have no DeepSeek-V3 equivalent)")
    if getattr(cfg, "sliding_window", None) and cfg.base_model_type == "mistral":
        problems.append(f"sliding window {cfg.sliding_window} (DeepSeek-V3 attends globally)")
    rope_type = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type != "default":
        problems.append(f"source rope_type {rope_type!r} (allowed: default)")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {cfg.hidden_act!r} (allowed: silu)")
    specs = cfg.attention_layers
    if any(s["kind"] != "mla" for s in specs):
        problems.append("layers that are not MLA (allowed: every layer kind 'mla')")
    else:
        if len({s["kv_lora_rank"] for s in specs}) > 1:
            problems.append("uneven kv_lora_rank across layers (allowed: one rank)")
        if len({len(s["rope_pairs"][0]) for s in specs}) > 1:
            problems.append("uneven rope key widths across layers (allowed: one width)")
        if any(len(s["rope_pairs"]) > 1 for s in specs):
            problems.append("per-head rope keys (allowed: one rope key shared by all heads, rope_key: shared)")
        if not all(s.get("latent_norm") for s in specs):
            problems.append("an unnormalised latent (allowed: latent_norm: true)")
    if any(s.get("sinks") for s in specs):
        problems.append("sink logits (DeepSeek-V3 has none)")
    for layer in model.model.layers:
        attn = layer.self_attn
        kv_b_bias = getattr(getattr(attn, "kv_b_proj", None), "bias", None)
        if getattr(attn.q_proj, "bias", None) is not None or (kv_b_bias is not None and kv_b_bias.abs().max() > 0):
            problems.append("query or up-projection biases (allowed: a latent bias only)")
            break
    return problems


__all__ = ["EXPORTABLE_BASES", "export_problems"]
