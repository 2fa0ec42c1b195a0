"""Perplexity maths: mean next-token negative log-likelihood over token windows, in float64."""

from __future__ import annotations

import math

import torch

from ..errors import InputError

# Upper bound on float64 log-prob elements materialised at once (~256 MiB), so
# large vocabularies (e.g. 262k for Gemma) do not blow up memory.
_MAX_LOGPROB_ELEMS = 1 << 25


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



def head_log_probs(model, hidden: torch.Tensor) -> torch.Tensor:
    """float64 next-token log-probabilities from final hidden states ``[n, d]`` -> ``[n, vocab]``:
    the model's output head (``lm_head``) and its final logit soft-capping (Gemma), as its forward
    applies them. Lets callers score a few positions without materialising ``[T, vocab]`` logits."""
    logits = model.lm_head(hidden).double()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return torch.log_softmax(logits, dim=-1)


__all__ = ["head_log_probs", "mean_nll"]
