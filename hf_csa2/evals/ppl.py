"""Perplexity on real text, comparable across models that share a tokenizer.

The protocol is fixed so that numbers from different runs/models line up:

* text comes from ``hf_csa2.data.corpus`` (a path or ``"python-docs:heldout"``
  style spec), files concatenated in sorted order;
* it is tokenized once, without special tokens, and cut into NON-overlapping
  windows of exactly ``window`` tokens (the ragged tail is dropped);
* each window is scored independently (no carried state), predicting every
  position but the first: ``N * (window - 1)`` tokens in total;
* log-probabilities are computed and accumulated in float64.
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

from hf_csa2.data.corpus import read_text, resolve_text
from hf_csa2.errors import InputError

# English BPE averages ~4 chars/token; reading 8x the tokens we need usually
# covers max_windows in one pass, and we double and retry if it does not.
_CHARS_PER_TOKEN_BUDGET = 8
_MIN_CHAR_BUDGET = 4096
# Cutting the text mid-word can change how the last few tokens are split, so a
# truncated read must overshoot what we keep by at least this many tokens.
_TAIL_MARGIN_TOKENS = 64
# Upper bound on float64 log-prob elements materialised at once (~256 MiB), so
# large vocabularies (e.g. 262k for Gemma) do not blow up memory.
_MAX_LOGPROB_ELEMS = 1 << 25


def _encode(tokenizer, text: str) -> list[int]:
    # verbose=False: the whole corpus is far longer than model_max_length on
    # purpose, and the "sequence too long" warning would be noise.
    enc = tokenizer(text, add_special_tokens=False, return_attention_mask=False, verbose=False)
    return list(enc["input_ids"])


def _token_stream(tokenizer, path: Path, need: int | None) -> list[int]:
    """Token ids of ``read_text(path)``; at least the first ``need`` of them are
    identical to tokenizing the whole text, but only a prefix is read."""
    if need is None:
        return _encode(tokenizer, read_text(path))
    budget = max(need * _CHARS_PER_TOKEN_BUDGET, _MIN_CHAR_BUDGET)
    while True:
        text = read_text(path, max_chars=budget)
        ids = _encode(tokenizer, text)
        if len(text) < budget or len(ids) >= need + _TAIL_MARGIN_TOKENS:
            return ids
        budget *= 2


def token_windows(
    tokenizer,
    text_path: str | os.PathLike,
    window: int = 512,
    max_windows: int | None = None,
) -> torch.LongTensor:
    """Cut the token stream of a text into non-overlapping windows.

    Args:
        tokenizer: a Hugging Face tokenizer (called with ``add_special_tokens=False``).
        text_path: file, directory, or named corpus spec (see
            ``hf_csa2.data.corpus.resolve_text``).
        window: tokens per window (>= 2, since the first token is never scored).
        max_windows: keep at most this many windows; only about as much text
            as needed (with generous headroom) is read and tokenized.

    Returns:
        LongTensor ``[N, window]`` with ``N = min(max_windows, len(stream) // window)``;
        ``windows.flatten()`` equals the first ``N * window`` ids of tokenizing
        the whole text, so every model with this tokenizer sees the same windows.

    Raises:
        ValueError: if the text yields no complete window.
    """
    if window < 2:
        raise ValueError(f"window must be >= 2 (first token is not predicted), got {window}")
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"max_windows must be >= 1 or None, got {max_windows}")
    path = resolve_text(text_path)
    need = None if max_windows is None else max_windows * window
    ids = _token_stream(tokenizer, path, need)
    n = len(ids) // window
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise InputError(
            f"text at {path} tokenizes to {len(ids)} tokens, fewer than one window of {window}"
        )
    return torch.tensor(ids[: n * window], dtype=torch.long).view(n, window)


def _model_device(model) -> torch.device:
    dev = getattr(model, "device", None)
    if isinstance(dev, torch.device):
        return dev
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def _check_vocab(model, windows: torch.Tensor) -> None:
    # An out-of-range id would otherwise surface as an opaque indexing error
    # deep inside the embedding (or silently wrong on some backends).
    get_emb = getattr(model, "get_input_embeddings", None)
    emb = get_emb() if callable(get_emb) else None
    n = getattr(emb, "num_embeddings", None)
    if n is not None and windows.numel() and int(windows.max()) >= n:
        raise InputError(
            f"token id {int(windows.max())} is outside the model's embedding table "
            f"({n} rows); the windows were made with a different tokenizer"
        )


def _safe_exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:  # a badly broken model; still report it
        return math.inf


def mean_nll(model, windows: torch.Tensor, batch_size: int = 1) -> dict:
    """Mean next-token negative log-likelihood of ``model`` over ``windows``.

    Args:
        model: causal LM returning ``.logits`` of shape ``[B, W, V]``.
        windows: LongTensor ``[N, W]`` (from ``token_windows``), W >= 2.
        batch_size: windows per forward pass (memory/speed trade-off only;
            results are the same up to floating-point kernel differences).

    Returns:
        ``{"nll": float, "ppl": exp(nll), "tokens": N * (W - 1)}``. Positions
        1..W-1 of every window are predicted from the preceding ones; the log
        softmax and the sum are done in float64. The model runs in eval mode
        under ``torch.no_grad`` with ``use_cache=False``; its previous
        train/eval mode is restored afterwards.
    """
    if windows.ndim != 2 or windows.shape[1] < 2 or windows.shape[0] < 1:
        raise ValueError(f"windows must be [N>=1, W>=2], got shape {tuple(windows.shape)}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    _check_vocab(model, windows)
    device = _model_device(model)
    n, w = windows.shape
    total = torch.zeros((), dtype=torch.float64)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, n, batch_size):
                batch = windows[start : start + batch_size].to(device)
                out = model(input_ids=batch, use_cache=False)
                logits = out.logits if hasattr(out, "logits") else out[0]
                vocab = logits.shape[-1]
                step = max(1, _MAX_LOGPROB_ELEMS // vocab)
                for row_logits, row_ids in zip(logits, batch):
                    for s in range(0, w - 1, step):
                        e = min(s + step, w - 1)
                        lp = torch.log_softmax(row_logits[s:e].double(), dim=-1)
                        tgt = row_ids[s + 1 : e + 1].unsqueeze(-1)
                        total -= lp.gather(-1, tgt).sum().cpu()
                del out, logits
    finally:
        model.train(was_training)
    tokens = n * (w - 1)
    nll = float(total / tokens)
    return {"nll": nll, "ppl": _safe_exp(nll), "tokens": tokens}


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
                ids = _token_stream(tokenizer, path, need=window)[:window]
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
) -> None:
    """Write results as strict JSON::

        {"results": [{"model", "ppl", "tokens", "nll", "ratio"}, ...],
         "window": W, "max_windows": N or null, "text": "<text spec as given>"}

    ``window``/``max_windows``/``text`` default to the attributes of a
    ``PplResults`` from ``compare_ppl``; pass them explicitly for a plain list.
    Non-finite ``ppl``/``nll``/``ratio`` are written as ``null``. Parent
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
    }
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
