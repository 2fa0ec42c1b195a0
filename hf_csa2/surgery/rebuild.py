"""Rebuilding a model with new per-layer attention specs, carrying its weights over.

The new model is built on the meta device and takes the source's tensors by assignment
(``load_state_dict(assign=True)``), the way ``from_pretrained`` loads: embeddings, MLPs, norms
and the output head are the source's own tensors, not copies, so a conversion holds about
one model in memory. Attention weights are copied, since the surgery rewrites them in place
and the source must stay intact (it is the target of every fit and the distillation teacher);
parameters the source lacks (sinks, latent projections, readers, indexers) are allocated and
initialised by the model's own ``_init_weights``.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from ..model import Csa2Config, Csa2ForCausalLM

REWRITTEN = ".self_attn."  # state-dict keys the surgery writes: copied, never shared with the source


def is_csa2(model) -> bool:
    return isinstance(model.config, Csa2Config)


def to_csa2(model: PreTrainedModel, attention_layers: list[dict], state: dict | None = None) -> Csa2ForCausalLM:
    """Rebuild ``model`` (native or hf_csa2) as a Csa2ForCausalLM with new per-layer specs,
    taking ``state`` (default: the model's own state dict); parameters it lacks, such as
    new sinks, get their init. Attention tensors of ``model`` are copied; every other tensor
    of ``state`` is taken as it is (see the module docstring)."""
    base_cfg = model.config.to_base_config() if is_csa2(model) else model.config
    config = Csa2Config.from_base_config(base_cfg, attention_layers)
    config._attn_implementation = model.config._attn_implementation or "sdpa"
    with torch.device("meta"):
        new = Csa2ForCausalLM(config)
    own = model.state_dict()
    source = own if state is None else state
    # Copy only attention tensors that ARE the source's: tensors a fit computed (``state``)
    # are new already, and a second copy of them would double the attention's peak memory.
    owned = {t.untyped_storage().data_ptr() for t in own.values()}
    wanted = new.state_dict().keys()  # e.g. MLA layers have no k_proj/v_proj: never copy those

    def taken(key: str, tensor: torch.Tensor) -> torch.Tensor:
        copy = REWRITTEN in key and tensor.untyped_storage().data_ptr() in owned
        return tensor.detach().clone() if copy else tensor

    adopt_weights(new, {k: taken(k, v) for k, v in source.items() if k in wanted}, model.dtype)
    new.generation_config = model.generation_config
    return new.eval()


def to_native(model: Csa2ForCausalLM) -> PreTrainedModel:
    """The source architecture's own model class, when the specs need nothing of ours; it
    shares every tensor with ``model`` (which the caller then drops)."""
    if not model.config.uses_only_native_features:
        raise ValueError("this model uses hf_csa2 features (sinks or per-layer KV heads); it cannot be native")
    base_cfg = model.config.to_base_config()
    base_cfg.num_key_value_heads = model.config.attention_layers[0]["num_key_value_heads"]
    with torch.device("meta"):
        native = MODEL_FOR_CAUSAL_LM_MAPPING[type(base_cfg)](base_cfg)
    adopt_weights(native, model.state_dict(), model.dtype, strict=True)
    native.generation_config = model.generation_config
    return native.eval()


def adopt_weights(model: PreTrainedModel, state: dict, dtype: torch.dtype, strict: bool = False) -> None:
    """Give a meta-device ``model`` the tensors of ``state`` it has (by assignment: shared, not
    copied; shapes must match), then allocate everything else (parameters ``state`` lacks,
    non-persistent buffers such as RoPE frequencies) and initialise it with the model's
    ``_init_weights``. ``strict``: every parameter must come from ``state``."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    if strict and missing:
        raise RuntimeError(f"weights missing for {missing[:5]}")
    bad = [k for k in own if k in state and own[k].shape != state[k].shape]
    if bad:
        raise RuntimeError(f"shape mismatch for {bad[:5]}")
    model.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False, assign=True)
    for tensor in model.state_dict(keep_vars=True).values():
        if not tensor.is_meta:
            tensor._is_hf_initialized = True  # transformers' init functions skip flagged tensors
    owners = []
    for module in model.modules():
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if tensor is None or not tensor.is_meta:
                continue
            # zeros, not empty: a parameter no init covers must not hold stale memory
            value = torch.zeros_like(tensor, device="cpu", dtype=dtype if tensor.is_floating_point() else tensor.dtype)
            if isinstance(tensor, torch.nn.Parameter):
                module.register_parameter(name, torch.nn.Parameter(value, requires_grad=tensor.requires_grad))
            else:
                module.register_buffer(name, value, persistent=name not in module._non_persistent_buffers_set)
            if not owners or owners[-1] is not module:
                owners.append(module)
    for module in model.modules():  # post_init on the meta device marked every module done
        module._is_hf_initialized = False
    model.initialize_weights()  # dispatches to the inner source model's own init (e.g. Gemma3 RoPE tables)
    for module in owners:  # ours too (sinks, readers), which the inner model's init does not know
        model._init_weights(module)
    model.tie_weights()
    left = [k for k, v in model.state_dict(keep_vars=True).items() if v.is_meta]
    if left:
        raise RuntimeError(f"tensors left on the meta device: {left[:5]}")


def native_specs(config) -> list[dict]:
    """Per-layer specs describing a native (source-architecture) config."""
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return [{"kind": "dense", "num_key_value_heads": kv, "sinks": False} for _ in range(config.num_hidden_layers)]


__all__ = ["adopt_weights", "is_csa2", "native_specs", "to_csa2", "to_native"]
