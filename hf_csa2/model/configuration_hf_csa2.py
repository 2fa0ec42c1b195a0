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
  (multi-head latent attention: see ``latent_attention.py``).
* CSA2 shared-KV sparse layers, ``{"kind": "csa2", "mode": "full" | "reindex" | "reuse" | "swa",
  "window": W, ...}`` (see ``csa2_attention.py``): ``full`` adds the MLA fields plus ``top_k``,
  ``index_heads``, ``index_head_dim``, ``index_rope_pairs``; ``reindex`` has ``source``,
  ``top_k``, ``index_heads``; ``reuse`` has ``source``.
* ``mla_attention_path`` -- how MLA layers compute: ``"auto"`` (explicit up-projection for
  prefill, absorbed for one-token decode steps), ``"explicit"`` or ``"absorbed"``.
* ``csa2_read_path`` -- how CSA2 layers read their selected entries: ``"gather"`` (the
  reference, O(T * (K + W)) memory) or ``"scores"`` (full logits then pick; O(T * S) memory,
  faster on short sequences); see ``sparse_attention.py``.

This file must import only torch/transformers and its siblings: it is copied next to the
weights so that ``trust_remote_code=True`` loads a checkpoint without hf_csa2 installed.
"""

from __future__ import annotations

import copy
from typing import Any

from transformers import AutoConfig, PreTrainedConfig

SUPPORTED_BASE_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")
ATTENTION_KINDS = ("dense", "mla", "csa2")
CSA2_MODES = ("swa", "full", "reindex", "reuse")
QK_NORM_BASE_MODEL_TYPES = ("qwen3", "gemma3_text")
MLA_ATTENTION_PATHS = ("auto", "explicit", "absorbed")
CSA2_READ_PATHS = ("gather", "scores")


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
        "auto_map",
        "architectures",
        "transformers_version",
        "_name_or_path",
        "name_or_path",
        "_attn_implementation_autoset",
    }
)


def validate_attention_spec(spec: dict[str, Any], layer_idx: int, num_attention_heads: int,
                            head_dim: int | None = None, qk_norm: bool = False) -> dict[str, Any]:
    """Check one per-layer attention spec and return it with defaults filled in.

    Raises ``ValueError`` naming the layer, the field and the allowed values.
    """
    where = f"attention_layers[{layer_idx}]"
    if not isinstance(spec, dict):
        raise ValueError(f"{where} must be a mapping, got {type(spec).__name__}")
    spec = dict(spec)
    kind = spec.setdefault("kind", "dense")
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"{where}.kind={kind!r}; allowed: {', '.join(ATTENTION_KINDS)}")
    kv_heads = spec.get("num_key_value_heads")
    if not isinstance(kv_heads, int) or kv_heads < 1 or num_attention_heads % kv_heads:
        divisors = [d for d in range(1, num_attention_heads + 1) if num_attention_heads % d == 0]
        raise ValueError(
            f"{where}.num_key_value_heads={kv_heads!r} must divide "
            f"num_attention_heads={num_attention_heads}; allowed: {divisors}"
        )
    spec["sinks"] = bool(spec.get("sinks", False))
    allowed_keys = {"kind", "num_key_value_heads", "sinks"}
    if kind == "mla" or (kind == "csa2" and spec.get("mode") == "full"):
        allowed_keys |= {"kv_lora_rank", "rope_pairs", "latent_norm"}
        spec["latent_norm"] = bool(spec.get("latent_norm", False))
        _validate_mla(spec, where, kv_heads, head_dim, qk_norm)
    if kind == "csa2":
        allowed_keys |= _validate_csa2_layer(spec, where, head_dim)
    unknown = set(spec) - allowed_keys
    if unknown:
        raise ValueError(f"{where} has unknown keys {sorted(unknown)}; allowed for kind={kind!r}: {sorted(allowed_keys)}")
    return spec


def _validate_mla(spec: dict, where: str, kv_heads: int, head_dim: int | None, qk_norm: bool) -> None:
    rank = spec.get("kv_lora_rank")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{where}.kv_lora_rank={rank!r} must be an integer >= 1")
    pairs = spec.get("rope_pairs")
    if not isinstance(pairs, list) or len(pairs) not in (1, kv_heads) or not all(isinstance(p, list) for p in pairs):
        raise ValueError(
            f"{where}.rope_pairs must be a list of pair-index lists, one per KV head ({kv_heads}) "
            f"or one shared by all heads (1)"
        )
    if qk_norm and len(pairs) == 1 and kv_heads > 1:
        raise ValueError(
            f"{where}.rope_pairs: a QK-norm source normalises each key head separately, so the rope key "
            f"cannot be shared by {kv_heads} KV heads; give one list per KV head"
        )
    sizes = {len(p) for p in pairs}
    if len(sizes) != 1:
        raise ValueError(f"{where}.rope_pairs lists must all have the same length, got sizes {sorted(sizes)}")
    half = None if head_dim is None else head_dim // 2
    mixed = len(pairs) == 1 and kv_heads > 1  # a shared key's slots may repeat a frequency
    for p in pairs:
        if (not mixed and len(set(p)) != len(p)) or any(
            not isinstance(i, int) or i < 0 or (half is not None and i >= half) for i in p
        ):
            raise ValueError(f"{where}.rope_pairs entries must be distinct pair indices in [0, {half}); got {p}")
    spec["rope_pairs"] = [sorted(p) for p in pairs]


def _positive_int(spec: dict, key: str, where: str) -> int:
    value = spec.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{where}.{key}={value!r} must be an integer >= 1")
    return value


def _validate_csa2_layer(spec: dict, where: str, head_dim: int | None) -> set[str]:
    """Per-layer checks of a ``kind: csa2`` spec; returns the keys its mode allows."""
    mode = spec.get("mode")
    if mode not in CSA2_MODES:
        raise ValueError(f"{where}.mode={mode!r}; allowed: {', '.join(CSA2_MODES)}")
    _positive_int(spec, "window", where)
    keys = {"mode", "window"}
    if mode in ("full", "reindex"):
        _positive_int(spec, "top_k", where)
        _positive_int(spec, "index_heads", where)
        keys |= {"top_k", "index_heads", "index_head_dim", "index_rope_pairs"}
    if mode == "full":
        _positive_int(spec, "index_head_dim", where)
        pairs = spec.setdefault("index_rope_pairs", [])
        half = None if head_dim is None else head_dim // 2
        if (not isinstance(pairs, list) or len(set(pairs)) != len(pairs)
                or any(not isinstance(i, int) or i < 0 or (half is not None and i >= half) for i in pairs)
                or 2 * len(pairs) > spec["index_head_dim"]):
            raise ValueError(
                f"{where}.index_rope_pairs={pairs!r} must be distinct pair indices in [0, {half}) "
                f"filling at most index_head_dim={spec['index_head_dim']} dims (2 per pair)"
            )
        spec["index_rope_pairs"] = sorted(pairs)
    if mode != "full":
        # Exact keys/values of the first tokens, kept for good (StreamingLLM's attention sinks).
        value = spec.setdefault("sink_tokens", 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{where}.sink_tokens={value!r} must be an integer >= 0")
        keys.add("sink_tokens")
    if mode in ("reindex", "reuse"):
        source = spec.get("source")
        if not isinstance(source, int) or isinstance(source, bool) or source < 0:
            raise ValueError(f"{where}.source={source!r} must be the index of an earlier layer")
        keys |= {"source", "entries"}  # entries: derived from the sources (validate_csa2_sources)
    return keys


def validate_csa2_sources(specs: list[dict]) -> list[dict]:
    """Cross-layer checks of CSA2 specs: every reindex/reuse layer reads an earlier layer of a
    mode that has what it needs, and inherits the index geometry of the entries it reads.

    A ``reindex`` layer needs an earlier ``full`` layer (its entries and index keys); a
    ``reuse`` layer an earlier ``full`` or ``reindex`` layer (entries and Top-K), and a window
    at least as wide as the one its Top-K was selected around (else positions between the two
    windows would be read by neither). Returns the specs with ``entries`` (the layer whose
    latent entries a reindex/reuse layer reads) and inherited index fields filled in.
    """
    specs = [dict(s) for s in specs]
    for i, spec in enumerate(specs):
        if spec.get("kind") != "csa2" or spec["mode"] not in ("reindex", "reuse"):
            continue
        where = f"attention_layers[{i}]"
        src = spec["source"]
        wanted = ("full",) if spec["mode"] == "reindex" else ("full", "reindex")
        if src >= i or specs[src].get("kind") != "csa2" or specs[src].get("mode") not in wanted:
            found = "a later layer" if src >= i else f"kind={specs[src].get('kind')!r} mode={specs[src].get('mode')!r}"
            raise ValueError(
                f"{where}: mode={spec['mode']!r} reads source={src}, which is {found}; it needs an earlier "
                f"csa2 layer of mode {' or '.join(wanted)}"
            )
        source = specs[src]
        spec["entries"] = src if source["mode"] == "full" else source["entries"]
        if spec["mode"] == "reindex":
            for key in ("index_head_dim", "index_rope_pairs"):
                given = spec.setdefault(key, source[key])
                if given != source[key]:
                    raise ValueError(
                        f"{where}.{key}={given!r}: a reindex layer scores its source's index keys, "
                        f"so it must equal layer {src}'s {source[key]!r}"
                    )
        elif spec["window"] < source["window"]:
            raise ValueError(
                f"{where}.window={spec['window']} is narrower than its source layer {src}'s window "
                f"{source['window']}: the Top-K it reuses skips that window; allowed: window >= {source['window']}"
            )
    return specs


class Csa2Config(PreTrainedConfig):
    """Config of :class:`Csa2ForCausalLM`: a flattened source config plus per-layer attention specs."""

    model_type = "hf_csa2"
    keys_to_ignore_at_inference = ["cache"]

    base_model_type: str = "llama"
    attention_layers: list | None = None
    mla_attention_path: str = "auto"
    csa2_read_path: str = "gather"

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
            head_dim = getattr(self, "head_dim", None) or (self.hidden_size // num_heads)
            qk_norm = self.base_model_type in QK_NORM_BASE_MODEL_TYPES
            self.attention_layers = validate_csa2_sources([
                validate_attention_spec(s, i, num_heads, head_dim, qk_norm) for i, s in enumerate(self.attention_layers)
            ])
        if self.mla_attention_path not in MLA_ATTENTION_PATHS:
            raise ValueError(f"mla_attention_path={self.mla_attention_path!r}; allowed: {', '.join(MLA_ATTENTION_PATHS)}")
        if self.csa2_read_path not in CSA2_READ_PATHS:
            raise ValueError(f"csa2_read_path={self.csa2_read_path!r}; allowed: {', '.join(CSA2_READ_PATHS)}")

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
    def uses_only_native_features(self) -> bool:
        """True when every layer is plain dense attention without sinks and one KV-head count:
        then the model can be saved in the source's own architecture."""
        kv = {s["num_key_value_heads"] for s in self.attention_layers}
        return all(s["kind"] == "dense" and not s["sinks"] for s in self.attention_layers) and len(kv) == 1


__all__ = ["CSA2_MODES", "Csa2Config", "MLA_ATTENTION_PATHS", "QK_NORM_BASE_MODEL_TYPES", "SUPPORTED_BASE_MODEL_TYPES", "validate_attention_spec", "validate_csa2_sources"]
