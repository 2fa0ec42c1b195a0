"""Typed per-layer attention specs: what kind of attention each decoder layer runs.

``Csa2Config.attention_layers`` keeps one JSON dict per layer (the form config.json stores);
``Csa2Config.layer_specs`` is the same list as frozen dataclasses, one class per attention module:

==========================  ======================  ==============================
JSON ``kind`` / ``mode``    spec class              module
==========================  ======================  ==============================
``dense``                   :class:`DenseSpec`      ``DenseSinkAttention``
``lowrank``                 :class:`LowRankSpec`    ``LowRankKVAttention``
``mla``                     :class:`MlaSpec`        ``LatentAttention``
``csa2`` / ``full``         :class:`Csa2FullSpec`   ``Csa2FullAttention``
``csa2`` / ``swa``,         :class:`Csa2ReaderSpec` ``Csa2ReaderAttention``
``reindex``, ``reuse``
==========================  ======================  ==============================

:meth:`AttentionSpec.from_dict` checks one layer's dict (types, ranges, unknown keys) against
the model's geometry and fills in defaults; :meth:`AttentionSpec.to_dict` writes the JSON form
back (defaults written out, pair lists sorted), so ``to_dict(from_dict(d))`` is what
config.json holds. :func:`check_csa2_sources` does the checks that span layers and fills in the
fields derived from them. Every error is a ``ValueError`` naming ``attention_layers[i].field``,
the bad value and what is allowed.

Self-contained (stdlib only): copied next to converted weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar, NamedTuple

ATTENTION_KINDS = ("dense", "lowrank", "mla", "csa2")
CSA2_MODES = ("swa", "full", "reindex", "reuse")


class _Geometry(NamedTuple):
    """Model-wide facts a layer is checked against; None = unknown, that check is skipped."""

    num_attention_heads: int | None
    head_dim: int | None
    qk_norm: bool


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is an int to isinstance


def _to_json(value: Any) -> Any:
    """Tuples (how specs hold lists, to stay immutable and hashable) back to JSON lists."""
    return [_to_json(v) for v in value] if isinstance(value, tuple) else value


def _int(data: Mapping, key: str, where: str, *, minimum: int = 1, default: Any = None,
         optional: bool = False) -> int | None:
    value = data.get(key, default)
    if value is None and optional:
        return None
    if not _is_int(value) or value < minimum:
        raise ValueError(f"{where}.{key}={value!r} must be an integer >= {minimum}")
    return value


def _flag(data: Mapping, key: str, where: str) -> bool:
    value = data.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"{where}.{key}={value!r} must be true or false")
    return value


def _rope_pairs(data: Mapping, where: str, kv_heads: int, g: _Geometry) -> tuple[tuple[int, ...], ...]:
    pairs = data.get("rope_pairs")
    if (not isinstance(pairs, (list, tuple)) or len(pairs) not in (1, kv_heads)
            or not all(isinstance(p, (list, tuple)) for p in pairs)):
        raise ValueError(
            f"{where}.rope_pairs must be a list of pair-index lists, one per KV head ({kv_heads}) "
            f"or one shared by all heads (1)"
        )
    if g.qk_norm and len(pairs) == 1 and kv_heads > 1:
        raise ValueError(
            f"{where}.rope_pairs: a QK-norm source normalises each key head separately, so the rope key "
            f"cannot be shared by {kv_heads} KV heads; give one list per KV head"
        )
    sizes = {len(p) for p in pairs}
    if len(sizes) != 1:
        raise ValueError(f"{where}.rope_pairs lists must all have the same length, got sizes {sorted(sizes)}")
    half = None if g.head_dim is None else g.head_dim // 2
    mixed = len(pairs) == 1 and kv_heads > 1  # a shared key's slots may repeat a frequency
    for p in pairs:
        if any(not _is_int(i) or i < 0 or (half is not None and i >= half) for i in p) or (
            not mixed and len(set(p)) != len(p)
        ):
            raise ValueError(f"{where}.rope_pairs entries must be distinct pair indices in [0, {half}); got {_to_json(p)}")
    return tuple(tuple(sorted(p)) for p in pairs)


def _index_rope_pairs(data: Mapping, where: str, index_head_dim: int | None, g: _Geometry,
                      default: Any) -> tuple[int, ...] | None:
    pairs = data.get("index_rope_pairs", default)
    if pairs is None:
        return None  # a reindex layer inherits its source's (check_csa2_sources)
    half = None if g.head_dim is None else g.head_dim // 2
    if (not isinstance(pairs, (list, tuple))
            or any(not _is_int(i) or i < 0 or (half is not None and i >= half) for i in pairs)
            or len(set(pairs)) != len(pairs)
            or (index_head_dim is not None and 2 * len(pairs) > index_head_dim)):
        raise ValueError(
            f"{where}.index_rope_pairs={_to_json(pairs)!r} must be distinct pair indices in [0, {half}) "
            f"filling at most index_head_dim={index_head_dim} dims (2 per pair)"
        )
    return tuple(sorted(pairs))


def _select_block(data: Mapping, where: str, top_k: int) -> int | None:
    block = _int(data, "select_block", where, minimum=2, optional=True)
    if block is not None and top_k % block:
        raise ValueError(f"{where}.select_block={block} does not divide top_k={top_k}: whole blocks are read; "
                         f"allowed: a divisor of {top_k} >= 2, or null (token-level selection)")
    return block


@dataclass(frozen=True, kw_only=True)
class AttentionSpec:
    """What every layer has. The JSON ``kind`` (and, for csa2, ``mode``) pick the subclass.

    Build from a dict with :meth:`from_dict`, which checks; the constructor trusts its arguments.
    """

    kind: ClassVar[str]
    # Flags added after checkpoints were saved: written only when set, so an older config saves
    # back byte for byte.
    _OPTIONAL_FLAGS: ClassVar[frozenset[str]] = frozenset({"exact_window"})
    num_key_value_heads: int  # KV heads of the layer; divides num_attention_heads
    sinks: bool = False  # one learned sink logit per query head (see sink_attention.py)

    @classmethod
    def from_dict(cls, data: Mapping, layer_idx: int, *, num_attention_heads: int | None = None,
                  head_dim: int | None = None, qk_norm: bool = False) -> AttentionSpec:
        """Check layer ``layer_idx``'s JSON dict and return its typed spec, defaults filled in.

        num_attention_heads / head_dim: the model's query heads and head width (the KV heads
        must divide the former, pair indices lie below half the latter); qk_norm: the source
        normalises each key head (then an MLA rope key cannot be shared by KV heads). Called
        on a subclass, the dict must describe that class. Cross-layer fields (``entries``,
        inherited index fields) are checked by :func:`check_csa2_sources`.
        """
        where = f"attention_layers[{layer_idx}]"
        if not isinstance(data, Mapping):
            raise ValueError(f"{where} must be a mapping, got {type(data).__name__}")
        spec_cls = _spec_class(data, where)
        if not issubclass(spec_cls, cls):
            raise ValueError(f"{where} describes a {spec_cls.__name__}; a {cls.__name__} is needed here")
        allowed = spec_cls._keys(data)
        unknown = set(data) - allowed
        if unknown:
            kind = data.get("kind", "dense")
            mode = f" mode={data['mode']!r}" if kind == "csa2" else ""
            raise ValueError(
                f"{where} has unknown keys {sorted(unknown, key=str)}; allowed for kind={kind!r}{mode}: {sorted(allowed)}"
            )
        return spec_cls(**spec_cls._read(data, where, _Geometry(num_attention_heads, head_dim, qk_norm)))

    def to_dict(self) -> dict[str, Any]:
        """The JSON form config.json stores (fields a mode does not use are left out)."""
        data: dict[str, Any] = {"kind": self.kind}
        if self.kind == "csa2":
            data["mode"] = self.mode
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and not (f.name in self._OPTIONAL_FLAGS and value is False):
                data[f.name] = _to_json(value)
        return data

    @classmethod
    def _keys(cls, data: Mapping) -> set[str]:
        """The JSON keys this class reads ("mode" included for csa2)."""
        return {"kind", *(["mode"] if cls.kind == "csa2" else []), *(f.name for f in fields(cls))}

    @classmethod
    def _read(cls, data: Mapping, where: str, g: _Geometry) -> dict[str, Any]:
        """Checked constructor arguments from ``data`` (subclasses add their fields)."""
        kv_heads, n = data.get("num_key_value_heads"), g.num_attention_heads
        if not _is_int(kv_heads) or kv_heads < 1 or (n is not None and n % kv_heads):
            if n is None:
                raise ValueError(f"{where}.num_key_value_heads={kv_heads!r} must be an integer >= 1")
            divisors = [d for d in range(1, n + 1) if n % d == 0]
            raise ValueError(
                f"{where}.num_key_value_heads={kv_heads!r} must divide num_attention_heads={n}; allowed: {divisors}"
            )
        return {"num_key_value_heads": kv_heads, "sinks": _flag(data, "sinks", where)}


@dataclass(frozen=True, kw_only=True)
class DenseSpec(AttentionSpec):
    """Dense softmax attention (``dense_attention.py``)."""

    kind: ClassVar[str] = "dense"


@dataclass(frozen=True, kw_only=True)
class LowRankSpec(AttentionSpec):
    """Dense attention over the layer's own keys and values, each cached as a rank-``r`` code
    of the token (keys before RoPE, rotated when read; ``lowrank_attention.py``)."""

    kind: ClassVar[str] = "lowrank"
    key_rank: int  # width of a cached key code
    value_rank: int  # width of a cached value code

    @classmethod
    def _read(cls, data, where, g):
        args = super()._read(data, where, g)
        width = None if g.head_dim is None else args["num_key_value_heads"] * g.head_dim
        for key in ("key_rank", "value_rank"):
            args[key] = _int(data, key, where)
            if width is not None and args[key] > width:
                raise ValueError(f"{where}.{key}={args[key]} exceeds the layer's key/value width "
                                 f"{width} (num_key_value_heads x head_dim); allowed: 1..{width}")
        return args


@dataclass(frozen=True, kw_only=True)
class MlaSpec(AttentionSpec):
    """Multi-head latent attention (``latent_attention.py``)."""

    kind: ClassVar[str] = "mla"
    kv_lora_rank: int  # width r of the cached latent
    # Per rope key (one per KV head, or one shared by all): the frequency pair of each of its
    # complex slots, ascending. A shared key of several KV heads may repeat a frequency.
    rope_pairs: tuple[tuple[int, ...], ...]
    latent_norm: bool = False  # RMS-normalise the latent (DeepSeek-V3's kv_a_layernorm)

    @classmethod
    def _read(cls, data, where, g):
        args = super()._read(data, where, g)
        args["kv_lora_rank"] = _int(data, "kv_lora_rank", where)
        args["rope_pairs"] = _rope_pairs(data, where, args["num_key_value_heads"], g)
        args["latent_norm"] = _flag(data, "latent_norm", where)
        return args


@dataclass(frozen=True, kw_only=True)
class Csa2FullSpec(MlaSpec):
    """CSA2 ``full`` layer: an MLA layer whose entries (and index keys) other layers read
    (``csa2_attention.py``)."""

    kind: ClassVar[str] = "csa2"
    mode: ClassVar[str] = "full"
    window: int  # the last `window` positions are always read
    top_k: int  # entries picked by the indexer among older positions
    index_heads: int  # indexer query heads
    index_head_dim: int  # width of an index key / query head
    index_rope_pairs: tuple[int, ...] = ()  # frequency pairs RoPE acts on in the index dims, ascending
    # Read the last `window` positions from the layer's own exact keys/values (a sliding cache,
    # as every reader layer does) instead of from its latent entries; the latent then serves
    # only the Top-K far reads (and the layers that share it).
    exact_window: bool = False
    select_block: int | None = None  # block-level selection: top_k / select_block whole blocks (indexer.py)

    @classmethod
    def _read(cls, data, where, g):
        args = super()._read(data, where, g)
        for key in ("window", "top_k", "index_heads", "index_head_dim"):
            args[key] = _int(data, key, where)
        args["index_rope_pairs"] = _index_rope_pairs(data, where, args["index_head_dim"], g, default=[])
        args["exact_window"] = _flag(data, "exact_window", where)
        args["select_block"] = _select_block(data, where, args["top_k"])
        return args


@dataclass(frozen=True, kw_only=True)
class Csa2ReaderSpec(AttentionSpec):
    """CSA2 ``swa`` / ``reindex`` / ``reuse`` layer: its own keys/values of the last ``window``
    tokens, plus (reindex/reuse) a full layer's entries at Top-K addresses (``csa2_attention.py``).

    Fields a mode does not use are None: ``source``/``entries`` are set for reindex and reuse,
    the index fields for reindex only.
    """

    kind: ClassVar[str] = "csa2"
    mode: str  # "swa", "reindex" or "reuse"
    window: int  # own exact keys/values of the last `window` tokens
    sink_tokens: int = 0  # the first tokens, kept exactly for good (StreamingLLM's attention sinks)
    source: int | None = None  # the earlier layer read: reindex -> a full layer; reuse -> full or reindex
    entries: int | None = None  # the full layer whose entries are read (derived from `source`)
    top_k: int | None = None  # reindex: entries picked by its own index queries
    index_heads: int | None = None  # reindex: its index query heads
    # reindex: the index geometry of its full layer's keys (inherited when not given)
    index_head_dim: int | None = None
    index_rope_pairs: tuple[int, ...] | None = None
    select_block: int | None = None  # reindex: block-level selection (as the full layer's field)

    _MODE_KEYS: ClassVar[dict[str, tuple[str, ...]]] = {
        "swa": (),
        "reuse": ("source", "entries"),
        "reindex": ("source", "entries", "top_k", "index_heads", "index_head_dim", "index_rope_pairs", "select_block"),
    }

    @classmethod
    def _keys(cls, data):
        return {"kind", "mode", "num_key_value_heads", "sinks", "window", "sink_tokens", *cls._MODE_KEYS[data["mode"]]}

    @classmethod
    def _read(cls, data, where, g):
        args = super()._read(data, where, g)
        mode = args["mode"] = data["mode"]
        args["window"] = _int(data, "window", where)
        args["sink_tokens"] = _int(data, "sink_tokens", where, minimum=0, default=0)
        if mode in ("reindex", "reuse"):
            source = data.get("source")
            if not _is_int(source) or source < 0:
                raise ValueError(f"{where}.source={source!r} must be the index of an earlier layer")
            args["source"] = source
            args["entries"] = _int(data, "entries", where, minimum=0, optional=True)
        if mode == "reindex":
            args["top_k"] = _int(data, "top_k", where)
            args["index_heads"] = _int(data, "index_heads", where)
            args["index_head_dim"] = _int(data, "index_head_dim", where, optional=True)
            args["index_rope_pairs"] = _index_rope_pairs(data, where, args["index_head_dim"], g, default=None)
            args["select_block"] = _select_block(data, where, args["top_k"])
        return args


def _spec_class(data: Mapping, where: str) -> type[AttentionSpec]:
    kind = data.get("kind", "dense")
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"{where}.kind={kind!r}; allowed: {', '.join(ATTENTION_KINDS)}")
    if kind != "csa2":
        return {"dense": DenseSpec, "lowrank": LowRankSpec, "mla": MlaSpec}[kind]
    mode = data.get("mode")
    if mode not in CSA2_MODES:
        raise ValueError(f"{where}.mode={mode!r}; allowed: {', '.join(CSA2_MODES)}")
    return Csa2FullSpec if mode == "full" else Csa2ReaderSpec


def check_csa2_sources(specs: Sequence[AttentionSpec]) -> list[AttentionSpec]:
    """Cross-layer checks of CSA2 specs: every reindex/reuse layer reads an earlier layer of a
    mode that has what it needs, and inherits the index geometry of the entries it reads.

    A ``reindex`` layer needs an earlier ``full`` layer (its entries and index keys); a
    ``reuse`` layer an earlier ``full`` or ``reindex`` layer (entries and Top-K), and a window
    at least as wide as the one its Top-K was selected around (else positions between the two
    windows would be read by neither). Returns the specs with ``entries`` (the layer whose
    latent entries a reindex/reuse layer reads) and inherited index fields filled in.
    """
    specs = list(specs)
    for i, spec in enumerate(specs):
        if not isinstance(spec, Csa2ReaderSpec) or spec.mode == "swa":
            continue
        where = f"attention_layers[{i}]"
        src = spec.source
        wanted = ("full",) if spec.mode == "reindex" else ("full", "reindex")
        source = specs[src] if src < i else None
        source_mode = getattr(source, "mode", None)  # only csa2 specs have a mode
        if source_mode not in wanted:
            found = "a later layer" if source is None else f"kind={source.kind!r} mode={source_mode!r}"
            raise ValueError(
                f"{where}: mode={spec.mode!r} reads source={src}, which is {found}; it needs an earlier "
                f"csa2 layer of mode {' or '.join(wanted)}"
            )
        derived = {"entries": src if source_mode == "full" else source.entries}
        if spec.mode == "reindex":
            for key in ("index_head_dim", "index_rope_pairs"):
                given, inherited = getattr(spec, key), getattr(source, key)
                if given is not None and given != inherited:
                    raise ValueError(
                        f"{where}.{key}={_to_json(given)!r}: a reindex layer scores its source's index keys, "
                        f"so it must equal layer {src}'s {_to_json(inherited)!r}"
                    )
                derived[key] = inherited
        elif spec.window < source.window:
            raise ValueError(
                f"{where}.window={spec.window} is narrower than its source layer {src}'s window "
                f"{source.window}: the Top-K it reuses skips that window; allowed: window >= {source.window}"
            )
        specs[i] = replace(spec, **derived)
    return specs


def parse_attention_layers(layers: Sequence[Mapping], *, num_attention_heads: int | None = None,
                           head_dim: int | None = None, qk_norm: bool = False) -> list[AttentionSpec]:
    """Typed, checked specs of a whole ``attention_layers`` list (per layer, then across layers)."""
    specs = [AttentionSpec.from_dict(data, i, num_attention_heads=num_attention_heads, head_dim=head_dim,
                                     qk_norm=qk_norm) for i, data in enumerate(layers)]
    return check_csa2_sources(specs)


__all__ = ["ATTENTION_KINDS", "CSA2_MODES", "AttentionSpec", "Csa2FullSpec", "Csa2ReaderSpec", "DenseSpec", "LowRankSpec", "MlaSpec",
           "check_csa2_sources", "parse_attention_layers"]
