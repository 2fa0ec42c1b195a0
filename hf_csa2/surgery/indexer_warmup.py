"""Indexer warm-up (DeepSeek-V3.2 DSA stage 1): train only an indexer so that the
distribution of its scores over the selectable positions matches the layer's dense
attention, summed over heads and renormalised. Everything else is frozen; runs on CPU over
the calibration windows in seconds per layer.

Selectable positions of query ``t`` are ``j <= t - window`` (the window is read anyway), so
the target is the dense attention mass there, renormalised; queries with no selectable
position carry no loss.
"""

from __future__ import annotations

import torch


def selectable_positions(t: int, window: int, first: int = 0, device=None) -> torch.Tensor:
    """[T, T] bool: key ``j`` is selectable for query ``t`` when ``first <= j <= t - window`` (the
    window is read anyway; a reader holds its first ``first`` tokens exactly)."""
    pos = torch.arange(t, device=device)
    return (pos[None, :] <= pos[:, None] - window) & (pos[None, :] >= first)


@torch.no_grad()
def dense_attention_targets(q: torch.Tensor, k: torch.Tensor, scaling: float, window: int,
                            first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Head-summed dense attention restricted to the selectable positions (:func:`selectable_positions`).

    q [N, HQ, T, D], k [N, H, T, D] (RoPE applied) -> (target [N, T, T] rows summing to 1 where
    valid, valid [N, T] bool).
    """
    n, hq, t, _ = q.shape
    k = k.repeat_interleave(hq // k.shape[1], dim=1)
    pos = torch.arange(t, device=q.device)
    logits = (q @ k.transpose(-1, -2)).float() * scaling
    logits = logits.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    mass = torch.softmax(logits, dim=-1).sum(1)  # [N, T, T]
    mass = mass * selectable_positions(t, window, first, q.device)
    total = mass.sum(-1, keepdim=True)
    valid = total[..., 0] > 0
    return mass / total.clamp_min(1e-30), valid


def index_log_probs(indexer, queries_hidden: torch.Tensor, position_embeddings, keys: torch.Tensor, window: int,
                    first: int = 0) -> torch.Tensor:
    """log-softmax of the index scores over the selectable positions [N, T, T] (-inf elsewhere)."""
    q, w = indexer.queries(queries_hidden, position_embeddings)
    scores = indexer.scores(q, w, keys)  # [N, T, S]
    selectable = selectable_positions(scores.shape[1], window, first, scores.device)
    return torch.log_softmax(scores.masked_fill(~selectable, float("-inf")), dim=-1)


@torch.no_grad()
def top_k_mass_recall(indexer, hidden: torch.Tensor, position_embeddings, keys: torch.Tensor, target: torch.Tensor,
                      valid: torch.Tensor, top_k: int, window: int, block: int = 0) -> float:
    """Mean share of the target mass that the indexer's Top-K selection (of whole blocks when
    ``block`` > 1) captures."""
    q, w = indexer.queries(hidden, position_embeddings)
    t = hidden.shape[1]
    top = indexer.select(q, w, keys, torch.arange(t, device=hidden.device), top_k, window, block=block)  # [N, T, K]
    picked = target.gather(-1, top.clamp_min(0)) * (top >= 0)
    return float(picked.sum(-1)[valid].mean()) if valid.any() else 1.0


def warm_up_indexer(indexer, hidden: torch.Tensor, position_embeddings, target: torch.Tensor, valid: torch.Tensor, *,
                    window: int, keys: torch.Tensor | None = None, steps: int = 100, lr: float = 1e-3,
                    batch_size: int = 4) -> dict[str, float]:
    """Train ``indexer`` (its own parameters only) to minimise KL(target || softmax(index scores)).

    hidden [N, T, hidden] (the layer's input), target/valid from :func:`dense_attention_targets`.
    ``keys`` [N, T, d_I]: fixed index keys of another layer (reindex); None = the indexer's own
    keys from ``hidden`` (trained too). Returns the KL before and after (nats per query).
    """
    if not valid.any():
        raise ValueError("no calibration query has a selectable position: windows must be longer than the layer's window")
    params = [p for p in indexer.parameters()]
    was = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=lr)
    n = hidden.shape[0]
    g = torch.Generator().manual_seed(0)

    def kl(idx) -> torch.Tensor:
        h = hidden[idx]
        pe = tuple(x[idx] if x.shape[0] == n else x for x in position_embeddings)
        k = indexer.keys(h, pe) if keys is None else keys[idx]
        logp = index_log_probs(indexer, h, pe, k, window)
        tgt, ok = target[idx], valid[idx]
        terms = torch.where(tgt > 0, tgt * (torch.log(tgt.clamp_min(1e-30)) - logp), torch.zeros_like(tgt)).sum(-1)
        return terms[ok].mean()

    with torch.enable_grad():
        with torch.no_grad():
            before = float(kl(torch.arange(n)))
        for _ in range(steps):
            idx = torch.randperm(n, generator=g)[:batch_size]
            loss = kl(idx)
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            after = float(kl(torch.arange(n)))
    for p, flag in zip(params, was):
        p.requires_grad_(flag)
    return {"index_kl_before": before, "index_kl_after": after}


__all__ = ["dense_attention_targets", "index_log_probs", "selectable_positions", "top_k_mass_recall", "warm_up_indexer"]
