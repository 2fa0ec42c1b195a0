"""Configuration of an hf-csa2 converted model.

The config is the source architecture's config, flattened (so ``config.vocab_size``,
``config.layer_types``, ``config.rope_parameters``... keep working for generation, caches
and masks), plus fields of ours:

* ``base_model_type`` -- the transformers ``model_type`` of the source (``"llama"``,
  ``"qwen2"``, ``"qwen3"``, ``"mistral"``, ``"gemma3_text"``). The modeling code builds that
  architecture and swaps only the attention modules.
* ``attention_layers`` -- one spec dict per decoder layer describing its attention, e.g.
  ``{"kind": "dense", "num_key_value_heads": 1, "sinks": True}`` or
  ``{"kind": "mla", "num_key_value_heads": 3, "kv_lora_rank": 64, "rope_pairs": [[0, 1], ...], "sinks": False}``
  (multi-head latent attention: see ``latent_attention.py``) or
  ``{"kind": "lowrank", "num_key_value_heads": 1, "key_rank": 128, "value_rank": 128, "sinks": False}``
  (own keys and values cached as rank-r codes: see ``lowrank_attention.py``).
* CSA2 shared-KV sparse layers, ``{"kind": "csa2", "mode": "full" | "reindex" | "reuse" | "swa",
  "window": W, ...}`` (see ``csa2_attention.py``): ``full`` adds the MLA fields plus ``top_k``,
  ``index_heads``, ``index_head_dim``, ``index_rope_pairs``; ``reindex`` has ``source``,
  ``top_k``, ``index_heads``; ``reuse`` has ``source``.

  The dicts are what config.json stores and what code outside this package reads and
  assigns; they are checked and normalised (defaults filled in) when the config is built.
  ``config.layer_specs`` gives the same list as typed specs (``layer_specs.py``, where every
  field is described), which the attention modules take.
* ``mla_attention_path`` -- how MLA layers compute: ``"auto"`` (explicit up-projection for
  prefill, absorbed for one-token decode steps), ``"explicit"`` or ``"absorbed"``.
* ``csa2_read_path`` -- how CSA2 layers read their selected entries: ``"auto"`` (the default:
  ``"triton"`` for tensors on a CUDA device when hf_csa2's kernels can run there, else
  ``"gather"``), ``"gather"`` (the
  reference, O(T * (K + W)) memory) or ``"scores"`` (full logits then pick; O(T * S) memory,
  faster on short sequences); see ``sparse_attention.py``; or ``"triton"`` (the fused kernel of
  ``hf_csa2.kernels.sparse_read``: needs hf_csa2 and Triton installed and a CUDA device, or
  ``TRITON_INTERPRET=1``; the attention weights some tools ask for still come from "gather").
  Where the fused read runs, the indexers score through ``hf_csa2.kernels.indexer`` too.
* ``dense_attention_path`` -- the softmax attention of dense and MLA layers under SDPA:
  ``"auto"`` (on CUDA, for layers with sinks: fla-core's Triton ``parallel_attn`` for prefills
  where fla-core is installed, hf_csa2's Triton decode kernel for decode steps where hf_csa2 is
  installed; else torch), ``"torch"`` (``sink_attention.sdpa_sink_attention``), ``"fla"``
  (fla-core wherever it applies: causal prefills and training windows without a padding mask;
  cached decode steps stay on torch) or ``"triton"`` (as "fla", and decode steps through
  ``hf_csa2.kernels.decode``; refused where either cannot run). See ``sink_attention.py``.

This file must import only torch/transformers, the standard library and its siblings: it is
copied next to the weights so that ``trust_remote_code=True`` loads a checkpoint without
hf_csa2 installed.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, TypeVar

from transformers import AutoConfig, PreTrainedConfig

from .layer_specs import CSA2_MODES, AttentionSpec, DenseSpec, parse_attention_layers
from .sink_attention import DENSE_ATTENTION_PATHS

SUPPORTED_BASE_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")
QK_NORM_BASE_MODEL_TYPES = ("qwen3", "gemma3_text")
MLA_ATTENTION_PATHS = ("auto", "explicit", "absorbed")
CSA2_READ_PATHS = ("auto", "gather", "scores", "triton")


def attention_head_dim(config) -> int:
    """Per-head width of a config: its ``head_dim`` when set (Gemma3/Qwen3 decouple it from the
    hidden size), else ``hidden_size // num_attention_heads``."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


# Keys of ours or of the serialisation machinery; everything else in the flattened dict
# belongs to the base architecture's config.
_OWN_KEYS = frozenset(
    {
        "model_type",
        "base_model_type",
        "attention_layers",
        "mla_attention_path",
        "csa2_read_path",
        "dense_attention_path",
        "auto_map",
        "architectures",
        "transformers_version",
        "_name_or_path",
        "name_or_path",
        "_attn_implementation_autoset",
    }
)


def layer_geometry(config) -> dict[str, Any]:
    """What a layer spec is checked against (:meth:`AttentionSpec.from_dict`'s keyword
    arguments): the config's query heads, head width and whether its source has QK-norm."""
    num_heads = getattr(config, "num_attention_heads", None)
    return {
        "num_attention_heads": num_heads,
        "head_dim": attention_head_dim(config) if num_heads else None,
        "qk_norm": getattr(config, "base_model_type", None) in QK_NORM_BASE_MODEL_TYPES,
    }


_Spec = TypeVar("_Spec", bound=AttentionSpec)


def as_layer_spec(spec: AttentionSpec | Mapping, layer_idx: int, config, expected: type[_Spec] = AttentionSpec) -> _Spec:
    """The typed spec of layer ``layer_idx``, an ``expected`` (or subclass).

    The attention modules take it; a JSON dict (what callers outside this package hold) is
    checked against ``config``'s geometry here. Its cross-layer fields (``entries``, inherited
    index fields) must already be filled in (:func:`validate_csa2_sources`).
    """
    if isinstance(spec, Mapping):
        spec = expected.from_dict(spec, layer_idx, **layer_geometry(config))
    if not isinstance(spec, expected):
        raise ValueError(f"attention_layers[{layer_idx}] is a {type(spec).__name__}; a {expected.__name__} is needed here")
    return spec


def validate_csa2_sources(specs: list[dict]) -> list[dict]:
    """:func:`check_csa2_sources` for a list of JSON dicts (plans built outside this package):
    each layer is checked on its own (without the model's geometry, which the config checks
    later), then across layers; returns the dicts with ``entries`` and inherited index fields
    filled in."""
    return [spec.to_dict() for spec in parse_attention_layers(specs)]


class Csa2Config(PreTrainedConfig):
    """Config of :class:`Csa2ForCausalLM`: a flattened source config plus per-layer attention specs."""

    model_type = "hf_csa2"
    keys_to_ignore_at_inference = ["cache"]

    base_model_type: str = "llama"
    attention_layers: list | None = None
    mla_attention_path: str = "auto"
    csa2_read_path: str = "auto"
    dense_attention_path: str = "auto"

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.base_model_type not in SUPPORTED_BASE_MODEL_TYPES:
            raise ValueError(
                f"base_model_type={self.base_model_type!r} is not supported; "
                f"allowed: {', '.join(SUPPORTED_BASE_MODEL_TYPES)}"
            )
        num_layers = getattr(self, "num_hidden_layers", None)
        num_heads = getattr(self, "num_attention_heads", None)
        if self.attention_layers is None and num_layers is not None:
            kv = getattr(self, "num_key_value_heads", None) or num_heads
            self.attention_layers = [{"kind": "dense", "num_key_value_heads": kv} for _ in range(num_layers)]
        if self.attention_layers is not None:
            if num_layers is not None and len(self.attention_layers) != num_layers:
                raise ValueError(
                    f"attention_layers has {len(self.attention_layers)} entries; "
                    f"num_hidden_layers={num_layers} requires one per layer"
                )
            self.attention_layers = [spec.to_dict() for spec in self.layer_specs]
        if self.mla_attention_path not in MLA_ATTENTION_PATHS:
            raise ValueError(f"mla_attention_path={self.mla_attention_path!r}; allowed: {', '.join(MLA_ATTENTION_PATHS)}")
        if self.csa2_read_path not in CSA2_READ_PATHS:
            raise ValueError(f"csa2_read_path={self.csa2_read_path!r}; allowed: {', '.join(CSA2_READ_PATHS)}")
        if self.dense_attention_path not in DENSE_ATTENTION_PATHS:
            raise ValueError(f"dense_attention_path={self.dense_attention_path!r}; allowed: "
                             f"{', '.join(DENSE_ATTENTION_PATHS)}")

    @classmethod
    def from_base_config(cls, base_config: PreTrainedConfig, attention_layers: list[dict]) -> "Csa2Config":
        """Wrap a source config (e.g. ``LlamaConfig``) with per-layer attention specs."""
        fields = {k: v for k, v in base_config.to_dict().items() if k not in _OWN_KEYS}
        fields.pop("quantization_config", None)
        return cls(base_model_type=base_config.model_type, attention_layers=attention_layers, **fields)

    def base_config_dict(self) -> dict[str, Any]:
        """The flattened fields that belong to the source architecture's config."""
        return {k: copy.deepcopy(v) for k, v in self.to_dict().items() if k not in _OWN_KEYS}

    def to_base_config(self) -> PreTrainedConfig:
        """Rebuild the source architecture's config object (e.g. ``LlamaConfig``)."""
        base = AutoConfig.for_model(self.base_model_type, **self.base_config_dict())
        base._attn_implementation = self._attn_implementation
        return base

    @property
    def layer_specs(self) -> list[AttentionSpec]:
        """The typed spec of each layer, built and checked from ``attention_layers`` on every
        access (a few checks per layer), so it follows reassignments and in-place edits."""
        return parse_attention_layers(self.attention_layers or [], **layer_geometry(self))

    @property
    def uses_only_native_features(self) -> bool:
        """True when every layer is plain dense attention without sinks and one KV-head count:
        then the model can be saved in the source's own architecture."""
        specs = self.layer_specs
        kv = {s.num_key_value_heads for s in specs}
        return all(type(s) is DenseSpec and not s.sinks for s in specs) and len(kv) == 1


__all__ = ["CSA2_MODES", "Csa2Config", "MLA_ATTENTION_PATHS", "QK_NORM_BASE_MODEL_TYPES", "SUPPORTED_BASE_MODEL_TYPES",
           "as_layer_spec", "attention_head_dim", "layer_geometry", "validate_csa2_sources"]
