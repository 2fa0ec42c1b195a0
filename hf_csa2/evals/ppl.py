"""Perplexity on real text, comparable across models that share a tokenizer.

The protocol is fixed so that numbers from different runs/models line up:

* text comes from ``hf_csa2.data.corpus`` (a path or ``"python-docs:heldout"``
  style spec), files concatenated in sorted order;
* it is tokenized once, without special tokens, and cut into NON-overlapping
  windows of exactly ``window`` tokens (the ragged tail is dropped;
  :func:`hf_csa2.data.windows.token_windows`);
* each window is scored independently (no carried state), predicting every
  position but the first: ``N * (window - 1)`` tokens in total;
* log-probabilities are computed and accumulated in float64
  (:func:`hf_csa2.metrics.perplexity.mean_nll`).
"""

from __future__ import annotations

import gc
import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ..data.corpus import resolve_text
from ..data.windows import token_stream, token_windows
from ..errors import InputError
from ..metrics.perplexity import mean_nll


class PplResults(list):
    """``compare_ppl``'s result: a plain list of per-model dicts that also
    remembers the settings (``window``, ``max_windows``, ``text``) that
    ``write_ppl_json`` records."""

    def __init__(self, items: Iterable[dict] = (), *, window: int, max_windows: int | None, text: str):
        super().__init__(items)
        self.window = window
        self.max_windows = max_windows
        self.text = text


ModelEntry = tuple  # (name, model, tokenizer) or (name, loader)


def _materialise(entry: ModelEntry) -> tuple[str, Any, Any]:
    if len(entry) == 3:
        return entry[0], entry[1], entry[2]
    if len(entry) == 2 and callable(entry[1]):
        loaded = entry[1]()
        if hasattr(loaded, "model") and hasattr(loaded, "tokenizer"):
            return entry[0], loaded.model, loaded.tokenizer
        model, tokenizer = loaded
        return entry[0], model, tokenizer
    raise TypeError(
        "each model entry must be (name, model, tokenizer) or (name, loader) with "
        f"loader() -> (model, tokenizer) or an object with .model/.tokenizer; got {entry!r}"
    )


def compare_ppl(
    models: Iterable[ModelEntry],
    text: str | os.PathLike,
    window: int = 512,
    max_windows: int | None = None,
    batch_size: int = 1,
) -> PplResults:
    """Perplexity of several models on the same token windows.

    Args:
        models: iterable of entries, evaluated in order. Each entry is either
            ``(name, model, tokenizer)`` (already loaded) or ``(name, loader)``
            where ``loader()`` returns ``(model, tokenizer)`` or an object with
            ``.model`` and ``.tokenizer`` (e.g. ``LoadedSource``). Loaders are
            called lazily, one at a time, and this function drops its
            references before calling the next one, so with loaders only one
            model is resident at a time (pass lambdas/partials to benefit).
        text: file, directory or named corpus spec (``"python-docs:heldout"``).
        window, max_windows: see ``token_windows``.
        batch_size: see ``mean_nll``.

    Returns:
        ``PplResults`` (a list) of ``{"model", "ppl", "nll", "tokens", "ratio"}``
        dicts, where ``ratio = ppl / ppl_of_first_model``. Windows are made
        with the FIRST model's tokenizer.

    Raises:
        ValueError: if a later tokenizer tokenizes the text of the first window
            to different ids (all models must share a tokenizer).
    """
    path = resolve_text(text)
    results = PplResults(window=window, max_windows=max_windows, text=os.fspath(text))
    windows: torch.Tensor | None = None
    for entry in models:
        name, model, tokenizer = _materialise(entry)
        try:
            if windows is None:
                windows = token_windows(tokenizer, path, window, max_windows)
            else:
                # token_windows guarantees windows[0] is the prefix of the
                # stream, so re-deriving just one window is an exact check.
                ids = token_stream(tokenizer, path, need=window)[:window]
                if ids != windows[0].tolist():
                    raise InputError(
                        f"model {name!r} uses a different tokenizer than {results[0]['model']!r}: "
                        "the first window tokenizes to different ids; perplexities over "
                        "different tokenizations are not comparable"
                    )
            r = mean_nll(model, windows, batch_size=batch_size)
        finally:
            # Release before the next loader runs so two models never coexist
            # (unless the caller holds references itself).
            del model, tokenizer, entry
            gc.collect()
        results.append({"model": name, "ppl": r["ppl"], "nll": r["nll"], "tokens": r["tokens"]})
    if not results:
        raise ValueError("compare_ppl needs at least one model")
    base = results[0]["ppl"]
    for r in results:
        r["ratio"] = r["ppl"] / base if base not in (0.0, math.inf) else math.nan
    return results


def _fmt_num(x: float, digits: int = 4) -> str:
    if not math.isfinite(x):
        return str(x)
    return f"{x:.{digits}e}" if abs(x) >= 1e6 else f"{x:.{digits}f}"


def format_ppl_table(results: Iterable[dict]) -> str:
    """Markdown table ``model | ppl | ratio to first | tokens``, columns aligned.

    ``ratio`` is taken from the dicts when present, else computed as
    ``ppl / first ppl``.
    """
    results = list(results)
    header = ("model", "ppl", "ratio to first", "tokens")
    base = results[0]["ppl"] if results else math.nan
    rows = []
    for r in results:
        ratio = r.get("ratio", r["ppl"] / base if base else math.nan)
        rows.append((str(r["model"]), _fmt_num(r["ppl"]), _fmt_num(ratio), str(r["tokens"])))
    widths = [max([len(h)] + [len(row[i]) for row in rows]) for i, h in enumerate(header)]

    def line(cells, right=(False, True, True, True)):
        return "| " + " | ".join(
            c.rjust(wd) if r else c.ljust(wd) for c, wd, r in zip(cells, widths, right)
        ) + " |"

    sep = "|" + "|".join(
        ("-" * (wd + 1) + ":") if i else ("-" * (wd + 2)) for i, wd in enumerate(widths)
    ) + "|"
    return "\n".join([line(header, (False,) * 4), sep, *(line(row) for row in rows)])


_UNSET: Any = object()


def _json_num(x: float) -> float | None:
    # Strict JSON has no inf/nan; a diverged model is reported as null.
    return x if math.isfinite(x) else None


def write_ppl_json(
    results: Iterable[dict],
    path: str | os.PathLike,
    *,
    window: int = _UNSET,
    max_windows: int | None = _UNSET,
    text: str | os.PathLike = _UNSET,
    command: str | None = None,
) -> None:
    """Write results as strict JSON::

        {"results": [{"model", "ppl", "tokens", "nll", "ratio"}, ...],
         "window": W, "max_windows": N or null, "text": "<text spec as given>", "command": "..."}

    ``window``/``max_windows``/``text`` default to the attributes of a
    ``PplResults`` from ``compare_ppl``; pass them explicitly for a plain list.
    Non-finite ``ppl``/``nll``/``ratio`` are written as ``null``; ``command`` (the
    command line that measured them, when given) is kept for model cards. Parent
    directories are created.
    """
    meta = {}
    for key, val in (("window", window), ("max_windows", max_windows), ("text", text)):
        if val is _UNSET:
            if not hasattr(results, key):
                raise ValueError(f"write_ppl_json: pass {key}= (results carry no {key!r})")
            val = getattr(results, key)
        meta[key] = os.fspath(val) if key == "text" else val
    doc = {
        "results": [
            {
                "model": r["model"],
                "ppl": _json_num(r["ppl"]),
                "tokens": int(r["tokens"]),
                "nll": _json_num(r["nll"]),
                "ratio": _json_num(r["ratio"]),
            }
            for r in results
        ],
        **meta,
        **({"command": command} if command else {}),
    }
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
