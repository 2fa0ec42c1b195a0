"""Export an hf-csa2 MLA checkpoint to the stock DeepSeek-V3 format (``DeepseekV3ForCausalLM``,
no remote code), so vLLM/SGLang-style servers that know DeepSeek-V3 can run it.

What the stock format can express, and therefore what an exportable model must be:

* MLA in every layer with ONE rope key shared by all heads (a single KV head, or a mixed
  shared key), a normalised latent (``kv_a_layernorm``), the same rank everywhere;
* no sinks, no query/up-projection biases (a latent bias maps to ``attention_bias``), no
  QK-norm, no sliding-window layers, SiLU-gated MLPs (llama, mistral without a window);
* a RoPE of the source's default type.

The mapping: ``q_proj`` gets, per head, the position-free query rows followed by the rope
rows (the complex query coefficients of a mixed key folded in), all scaled by
``scaling / (qk_head_dim ** -0.5)`` because DeepSeek-V3 derives its softmax scale from the
head width; ``kv_b_proj`` repeats each KV head's up-projection for every query head that reads
it (DeepSeek-V3 up-projects per query head). The rope slots' frequencies are arbitrary source
frequencies (possibly repeated); DeepSeek-V3 computes its frequencies from ``rope_parameters``,
so they are written as a ``longrope`` table (per-slot factors, ``attention_factor`` 1, the same
short and long tables) that reproduces them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from ..errors import UserError
from ..io.checkpoint import save_checkpoint
from ..io.output import OUTPUT_MARKER, check_output_dir
from ..io.sources import load_source, resolve_source
from ..formats import export_problems
from ..model import LatentAttention

EXPORT_FORMATS = ("deepseek_v3",)


class ExportError(UserError, ValueError):
    """The model uses something the target format cannot express; the message says what."""


def deepseek_v3_config(model) -> DeepseekV3Config:
    """The DeepSeek-V3 config equivalent to an exportable hf_csa2 MLA model."""
    cfg = model.config
    attn: LatentAttention = model.model.layers[0].self_attn
    rotary = model.model.rotary_emb
    inv_freq = rotary.inv_freq.double()
    pairs = cfg.attention_layers[0]["rope_pairs"][0]
    if any(s["rope_pairs"][0] != pairs for s in cfg.attention_layers):
        # Frequencies come from one rope_parameters table for all layers.
        raise ExportError("layers keep RoPE on different frequencies; DeepSeek-V3 has one rope table "
                          "(allowed: the same rope slots in every layer)")
    rope_dim = 2 * len(pairs)
    theta = cfg.rope_parameters["rope_theta"]
    # longrope: inv_freq_i = 1 / (factor_i * theta ** (2i / rope_dim)); choose factor_i to hit the slot's frequency.
    factors = [float(1.0 / (inv_freq[p].item() * theta ** (2 * i / rope_dim))) for i, p in enumerate(pairs)]
    return DeepseekV3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_attention_heads,
        n_shared_experts=1, n_routed_experts=1, num_experts_per_tok=1, n_group=1, topk_group=1,
        first_k_dense_replace=cfg.num_hidden_layers,  # every layer keeps a dense MLP
        kv_lora_rank=attn.kv_lora_rank, q_lora_rank=None, qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=attn.nope_width, v_head_dim=attn.head_dim, hidden_act=cfg.hidden_act,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=attn.kv_a_proj.bias is not None, rope_interleave=False,
        rope_parameters={
            "rope_type": "longrope", "rope_theta": theta, "short_factor": factors, "long_factor": factors,
            "original_max_position_embeddings": cfg.max_position_embeddings, "factor": 1.0, "attention_factor": 1.0,
        },
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=getattr(cfg, "pad_token_id", None),
    )


@torch.no_grad()
def _query_rows(attn: LatentAttention, scale: float) -> torch.Tensor:
    """DeepSeek-V3 ``q_proj`` weight [HQ * (D_nope + 2n), hidden]: per head its position-free
    rows then its rope rows (mixed-key coefficients folded in), times ``scale``."""
    d, hq = attn.head_dim, attn.num_heads
    w = attn.q_proj.weight.double().view(hq, d, -1)
    rope_dims, nope_dims = attn.rope_dims[0], attn.nope_dims[0]
    heads = []
    for r in range(hq):
        nope = w[r, nope_dims]
        rope = w[r, rope_dims]
        if attn.mixed_rope:
            coef = attn.q_rope_coef[attn.kv_of_query[r]].double()  # [n, 2]
            re, im = rope.chunk(2, dim=0)
            a, b = coef[:, :1], coef[:, 1:]
            rope = torch.cat([a * re - b * im, a * im + b * re])
        heads.append(torch.cat([nope, rope]))
    return torch.cat(heads) * scale


@torch.no_grad()
def to_deepseek_v3(model) -> DeepseekV3ForCausalLM:
    """The same network as a stock ``DeepseekV3ForCausalLM`` (raises :class:`ExportError`)."""
    problems = export_problems(model)
    if problems:
        raise ExportError("cannot export to deepseek_v3: " + "; ".join(problems))
    config = deepseek_v3_config(model)
    config._attn_implementation = model.config._attn_implementation or "sdpa"
    out = DeepseekV3ForCausalLM(config).to(model.dtype).eval()
    state = {k: v for k, v in model.state_dict().items() if ".self_attn." not in k}
    for i, layer in enumerate(model.model.layers):
        attn: LatentAttention = layer.self_attn
        prefix = f"model.layers.{i}.self_attn."
        scale = attn.scaling / (attn.nope_width + attn.rope_width) ** -0.5
        up = attn.kv_b_proj.weight.view(attn.num_key_value_heads, -1, attn.kv_lora_rank)[attn.kv_of_query]
        if config.attention_bias:  # DeepSeek-V3 then also gives o_proj a bias
            state[prefix + "kv_a_proj_with_mqa.bias"] = attn.kv_a_proj.bias
            o_bias = attn.o_proj.bias
            state[prefix + "o_proj.bias"] = torch.zeros_like(attn.o_proj.weight[:, 0]) if o_bias is None else o_bias
        state.update({
            prefix + "q_proj.weight": _query_rows(attn, scale).to(model.dtype),
            prefix + "kv_a_proj_with_mqa.weight": attn.kv_a_proj.weight,
            prefix + "kv_a_layernorm.weight": attn.kv_a_layernorm.weight,
            prefix + "kv_b_proj.weight": up.reshape(-1, attn.kv_lora_rank),
            prefix + "o_proj.weight": attn.o_proj.weight,
        })
    missing, unexpected = out.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight") or not config.tie_word_embeddings]
    if missing or unexpected:
        raise ExportError(f"weight mapping incomplete: missing {missing[:4]}, unexpected {unexpected[:4]}")
    if config.tie_word_embeddings:
        out.tie_weights()
    out.generation_config = model.generation_config
    return out


def export_checkpoint(model_dir: str | os.PathLike, out_dir: str | os.PathLike, fmt: str = "deepseek_v3",
                      overwrite: bool = False, trust_remote_code: bool = False) -> Path:
    """Load an hf_csa2 checkpoint folder and write it in ``fmt`` (atomic, source untouched).

    The output's ``conversion_report.json`` is the source folder's report with an ``export``
    entry (format and source folder) added.
    """
    if fmt not in EXPORT_FORMATS:
        raise ExportError(f"format {fmt!r}; allowed: {', '.join(EXPORT_FORMATS)}")
    inputs = [("checkpoint to export", resolve_source(model_dir)[1])]
    check_output_dir(out_dir, overwrite=overwrite, inputs=inputs)
    loaded = load_source(str(model_dir), check_supported=False, trust_remote_code=trust_remote_code)
    exported = to_deepseek_v3(loaded.model)
    report_path = loaded.path / OUTPUT_MARKER
    try:
        report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    except ValueError:
        report = {}
    if not isinstance(report, dict):
        report = {}
    report = {**report, "export": {"format": fmt, "from": str(loaded.path)}}
    extra = {OUTPUT_MARKER: json.dumps(report, indent=2)}
    plan_path = loaded.path / "hf_csa2_plan.yaml"
    if plan_path.is_file():
        extra[plan_path.name] = plan_path.read_text()
    return save_checkpoint(exported, loaded.tokenizer, out_dir, overwrite=overwrite, extra_files=extra, inputs=inputs)


__all__ = ["EXPORT_FORMATS", "ExportError", "deepseek_v3_config", "export_checkpoint", "export_problems", "to_deepseek_v3"]
