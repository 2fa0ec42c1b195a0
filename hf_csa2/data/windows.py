"""Token windows of a text: the fixed protocol every perplexity and calibration figure uses.

The text (a file, a folder, or a named corpus such as ``python-docs:heldout``) is tokenized
once, without special tokens, and cut into NON-overlapping windows of exactly ``window``
tokens (the ragged tail is dropped), so every model sharing a tokenizer sees the same windows.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..errors import InputError
from .corpus import read_text, resolve_text

# English BPE averages ~4 chars/token; reading 8x the tokens we need usually
# covers max_windows in one pass, and we double and retry if it does not.
_CHARS_PER_TOKEN_BUDGET = 8
_MIN_CHAR_BUDGET = 4096
# Cutting the text mid-word can change how the last few tokens are split, so a
# truncated read must overshoot what we keep by at least this many tokens.
_TAIL_MARGIN_TOKENS = 64


def _encode(tokenizer, text: str) -> list[int]:
    # verbose=False: the whole corpus is far longer than model_max_length on
    # purpose, and the "sequence too long" warning would be noise.
    enc = tokenizer(text, add_special_tokens=False, return_attention_mask=False, verbose=False)
    return list(enc["input_ids"])


def token_stream(tokenizer, path: Path, need: int | None) -> list[int]:
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
    ids = token_stream(tokenizer, path, need)
    n = len(ids) // window
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise InputError(
            f"text at {path} tokenizes to {len(ids)} tokens, fewer than one window of {window}"
        )
    return torch.tensor(ids[: n * window], dtype=torch.long).view(n, window)



__all__ = ["token_stream", "token_windows"]
