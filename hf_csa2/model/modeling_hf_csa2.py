"""Modeling of hf-csa2 converted checkpoints.

One code path for every supported source architecture: build the source causal LM from
transformers (Llama, Qwen2, Qwen3, Mistral, Gemma3) and swap each decoder layer's attention
module for one of ours, which adopts the source module's projections and norms (same
parameter names, so state dicts line up) and adds what the layer spec asks for: a different
number of KV heads and per-head sink logits (:class:`DenseSinkAttention`), low-rank codes of its own
keys and values (:class:`LowRankKVAttention`), or multi-head latent
attention (:class:`LatentAttention`), or CSA2 shared-KV sparse attention
(:class:`Csa2FullAttention`, :class:`Csa2ReaderAttention`).

Self-contained: imports only torch, transformers and sibling files, so ``save_pretrained``
can copy it next to the weights for ``trust_remote_code=True``.
"""

from __future__ import annotations

import copy
import functools
import inspect

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
from transformers.utils.generic import can_return_tuple

from .attention_base import SINK_OFF, AttentionBase
from .configuration_hf_csa2 import Csa2Config, as_layer_spec, layer_geometry
from .csa2_attention import Csa2FullAttention, Csa2ReaderAttention, EntryReader, own_cache_layer
from .dense_attention import DenseSinkAttention
from .latent_attention import LatentAttention
from .layer_specs import AttentionSpec, Csa2FullSpec, Csa2ReaderSpec, LowRankSpec, MlaSpec, parse_attention_layers
from .lowrank_attention import LowRankKVAttention


def build_attention(source: nn.Module, base_config, config: Csa2Config, layer_idx: int,
                    spec: AttentionSpec | dict) -> AttentionBase:
    """Create the layer's attention from its spec (typed, or a JSON dict): :class:`DenseSinkAttention`
    (dense) around a fresh source-architecture module with the spec's KV heads (so biases/norms
    match the source exactly), or :class:`LatentAttention` (MLA) adopting the source's
    query/output side, or the CSA2 module of its mode."""
    spec = as_layer_spec(spec, layer_idx, config)
    if isinstance(spec, Csa2FullSpec):
        return Csa2FullAttention(source, config, layer_idx, spec)
    if isinstance(spec, MlaSpec):
        return LatentAttention(source, config, layer_idx, spec)
    if spec.num_key_value_heads != base_config.num_key_value_heads:
        layer_config = copy.deepcopy(base_config)
        layer_config.num_key_value_heads = spec.num_key_value_heads
        source = type(source)(layer_config, layer_idx)
    if isinstance(spec, Csa2ReaderSpec):
        # The entries' layer is self-contained (a full layer): check just that one.
        entries = None if spec.entries is None else as_layer_spec(config.attention_layers[spec.entries], spec.entries, config)
        return Csa2ReaderAttention(source, config, layer_idx, spec, entries)
    if isinstance(spec, LowRankSpec):
        return LowRankKVAttention(source, config, layer_idx, spec)
    return DenseSinkAttention(source, config, layer_idx, spec)


def key_rotary(rotary: nn.Module, config, layer_idx: int):
    """``(x, position_ids) -> (cos, sin)`` of the source model's rotary module for layer
    ``layer_idx`` (Gemma-3 keeps one RoPE base per layer type and takes the type as an argument)."""
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        return functools.partial(rotary, layer_type=config.layer_types[layer_idx])
    return rotary


def padding_starts(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each row's first real position [B] from a 2-D mask [B, S] (1 = token) padded on the left
    and/or the right; a hole between tokens is refused (no reader could skip it)."""
    mask = attention_mask.bool()
    real = mask.any(dim=1)
    starts = torch.where(real, mask.int().argmax(dim=1), torch.zeros_like(real, dtype=torch.long))
    ends = torch.where(real, mask.shape[1] - mask.flip(1).int().argmax(dim=1), starts)
    span = torch.arange(mask.shape[1], device=mask.device)[None]
    inside = (span >= starts[:, None]) & (span < ends[:, None])
    if bool((inside & ~mask).any()):
        raise ValueError("attention_mask has padding between tokens; CSA2 layers take left- or right-padded rows "
                         "(transformers pads on the left for generation: tokenizer.padding_side = 'left')")
    return starts.long()


class Csa2PreTrainedModel(PreTrainedModel):
    config_class = Csa2Config
    config: Csa2Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    # Flash/flex paths in transformers drop sinks on CPU or altogether: refuse them at load.
    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_attention_backend = False

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, AttentionBase) and module.sinks is not None:
            init.constant_(module.sinks, SINK_OFF)
        if isinstance(module, EntryReader):
            init.zeros_(module.q_rope_coef)
            init.zeros_(module.logit_bias)


class Csa2ForCausalLM(Csa2PreTrainedModel, GenerationMixin):
    """A source causal LM (Llama/Qwen2/Qwen3/Mistral/Gemma3) with rewritten attention layers."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: Csa2Config):
        super().__init__(config)
        base_config = config.to_base_config()
        base_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(base_config)]
        base = base_cls(base_config)
        self.model = base.model
        self.lm_head = base.lm_head
        self.vocab_size = config.vocab_size
        # Not config.layer_specs: with trust_remote_code the config may come from another loaded
        # copy of these files, whose spec classes isinstance would not recognise here.
        specs = parse_attention_layers(config.attention_layers, **layer_geometry(config))
        for i, (layer, spec) in enumerate(zip(self.model.layers, specs)):
            layer.self_attn = build_attention(layer.self_attn, base_config, config, i, spec)
        # CSA2 layers read entries that earlier layers computed in the same forward.
        peers = [layer.self_attn for layer in self.model.layers]
        for i, attn in enumerate(peers):
            if isinstance(attn, Csa2ReaderAttention):
                attn.peers = peers
            if isinstance(attn, LowRankKVAttention):  # rebuilds rotated keys at cached positions
                attn.key_rotary = key_rotary(self.model.rotary_emb, base_config, i)
        # One config object at run time, so attn_implementation switches reach every module.
        for module in self.modules():
            if module is not self and isinstance(getattr(module, "config", None), type(base_config)):
                module.config = config
        if hasattr(self.model, "_can_record_outputs"):
            recorded = dict(self.model._can_record_outputs or {})
            recorded["attentions"] = AttentionBase
            self.model._can_record_outputs = recorded
        self.post_init()

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args, **kwargs):
        # CSA2 and MLA layers have their own cache layer classes; build them before the first forward so
        # that generate's cache hooks (past recording for assisted decoding) reach them.
        out = super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        cache = model_kwargs.get("cache")
        if cache is not None and hasattr(cache, "layers") and cache.get_seq_length() == 0:
            for layer in self.model.layers:
                if hasattr(layer.self_attn, "cache_layer_kind"):  # a cache that cannot take it: the forward says so
                    own_cache_layer(layer.self_attn, cache, required=False)
        return out

    @property
    def _reads_by_position(self) -> bool:
        # The JSON form: it is read on every forward, and layer_specs would check every layer each time.
        return any(spec["kind"] in ("csa2", "lowrank") for spec in self.config.attention_layers)

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Same contract as the source ``*ForCausalLM.forward``: logits [B, T, vocab]."""
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        if (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 and self._reads_by_position
                and not bool(attention_mask.all())):
            # CSA2 layers build their read sets from positions: they get each row's first real one.
            kwargs["csa2_row_starts"] = padding_starts(attention_mask)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])
        softcap = getattr(self.config, "final_logit_softcapping", None)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


__all__ = ["DenseSinkAttention", "LowRankKVAttention", "AttentionBase", "Csa2ForCausalLM", "Csa2FullAttention", "LatentAttention", "Csa2ReaderAttention", "Csa2PreTrainedModel", "SINK_OFF"]
