"""The window baseline (StreamingLLM): the source model with every layer restricted to its last ``W``
tokens and its first ``P`` (attention sinks), nothing converted or fitted. It is what a conversion
must beat at equal cache: it keeps ``W - 1 + P`` tokens per layer and reads nothing older.

Every command that takes a model takes one as ``window:W+P:SOURCE`` (e.g. ``window:512+4:gemma3-270m``):
the source's own weights in CSA2 ``swa`` layers (:class:`~hf_csa2.model.csa2_attention.Csa2ReaderAttention`,
a sliding-window cache that keeps the first tokens), so the KV accounting, the live cache, generation
and benchmarks treat it like any other model. A layer that already slides over fewer than ``W`` tokens
(Gemma-3's local layers) keeps its own window.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import InputError
from ..surgery.csa2 import as_dense_csa2
from ..surgery.rebuild import to_csa2

PREFIX = "window:"
_PATTERN = re.compile(r"window:(\d+)\+(\d+):(.+)")
FORM = "window:W+P:SOURCE (own window of W >= 2 tokens, P >= 0 first tokens kept), e.g. window:512+4:smollm2-135m"


@dataclass(frozen=True)
class WindowModel:
    """A parsed ``window:W+P:SOURCE``."""

    window: int
    first: int
    source: str


def parse_window_model(name: str) -> WindowModel | None:
    """The window baseline ``name`` asks for, or None when it is an ordinary model name."""
    if not str(name).startswith(PREFIX):
        return None
    match = _PATTERN.fullmatch(str(name))
    if match is None or int(match.group(1)) < 2:
        raise InputError(f"model {name!r}: a window baseline is written {FORM}")
    return WindowModel(int(match.group(1)), int(match.group(2)), match.group(3))


def layer_windows(config, window: int) -> list[int]:
    """Each layer's window in the baseline: ``window``, or the layer's own sliding window when shorter."""
    base = config.to_base_config() if hasattr(config, "to_base_config") else config
    own = getattr(base, "sliding_window", None)
    # no layer_types with a sliding window (Mistral): every layer slides
    types = getattr(base, "layer_types", None) or ["sliding_attention" if own else "full_attention"] * base.num_hidden_layers
    return [min(window, own) if t == "sliding_attention" and own else window for t in types]


def window_model(model, window: int, first: int):
    """``model`` (native or hf_csa2 with dense layers) with every layer reading its last ``window``
    tokens (:func:`layer_windows`) and its first ``first`` tokens; a new model, ``model`` unchanged."""
    dense = as_dense_csa2(model)
    kinds = sorted({s["kind"] for s in dense.config.attention_layers} - {"dense"})
    if kinds:
        raise InputError(f"a window baseline is built from a model with dense attention layers; this one has {', '.join(kinds)}")
    specs = [{"kind": "csa2", "mode": "swa", "window": w, "sink_tokens": first,
              "num_key_value_heads": s["num_key_value_heads"], "sinks": s.get("sinks", False)}
             for s, w in zip(dense.config.attention_layers, layer_windows(dense.config, window))]
    return to_csa2(dense, specs)


__all__ = ["FORM", "PREFIX", "WindowModel", "layer_windows", "parse_window_model", "window_model"]
