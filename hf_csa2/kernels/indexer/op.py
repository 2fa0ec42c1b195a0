"""Autograd wrapper of the masked-score kernels and the public functions."""

from __future__ import annotations

import torch

from .. import require_available

_REFERENCE = "hf_csa2.model.indexer.masked_scores"
_REFERENCE_SELECT = "hf_csa2.model.indexer.select_top_k"


def _kernels():
    # Triton is imported on first use only, so this package imports without it
    from . import kernel

    return kernel


class MaskedScoresFunction(torch.autograd.Function):
    """scores [B, T, S] fp32; differentiable in queries, weights and keys."""

    @staticmethod
    def forward(ctx, queries, weights, keys, query_positions, window, starts):
        scores = _kernels().masked_scores_forward(queries, weights, keys, query_positions, window, starts)
        ctx.save_for_backward(queries, weights, keys, query_positions, starts)
        ctx.window = window
        return scores

    @staticmethod
    def backward(ctx, grad):
        queries, weights, keys, query_positions, starts = ctx.saved_tensors
        dq, dw, dk = _kernels().masked_scores_backward(queries, weights, keys, query_positions, ctx.window, starts,
                                                       grad)
        return dq, dw, dk, None, None, None


def masked_index_scores(queries: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                        query_positions: torch.Tensor, window: int, starts: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton version of :func:`hf_csa2.model.indexer.masked_scores`.

    Args:
        queries: index queries [B, T, n_I, d_I].
        weights: head weights [B, T, n_I].
        keys: index keys [B, S, d_I] at positions 0..S-1.
        query_positions: absolute position of each query [T] (long).
        window: the reader's window W; position ``j`` is selectable by the query at ``p`` when
            ``j <= p - W``.
        starts: each row's first real position [B] (left padding is never selectable), or None.

    Returns:
        ``sum_n w_n * ReLU(q_n . k_j)`` [B, T, S] fp32, -inf where ``j`` is not selectable.
        Differentiable in queries, weights and keys (no gradient flows through -inf entries).
    """
    require_available("masked_index_scores", _REFERENCE)
    _check(queries, weights, keys, query_positions, starts)
    return MaskedScoresFunction.apply(queries, weights, keys, query_positions, int(window), starts)


def fused_select_top_k(queries: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                       query_positions: torch.Tensor, top_k: int, window: int,
                       starts: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton version of :func:`hf_csa2.model.indexer.select_top_k` run on
    :func:`masked_index_scores`: scoring and Top-K in one kernel, the [T, S] scores never in memory.

    Args: as :func:`masked_index_scores`, plus ``top_k`` (K >= 1).

    Returns:
        positions [B, T, top_k] long, best first, ties to the earlier position, -1 where fewer
        than K are selectable: equal to ``select_top_k(..., scores=masked_index_scores)``.
        Not differentiable (positions).
    """
    require_available("fused_select_top_k", _REFERENCE_SELECT)
    _check(queries, weights, keys, query_positions, starts)
    if int(top_k) < 1:
        raise ValueError(f"top_k is {top_k}; it must be >= 1")
    return _kernels().top_k_forward(queries.detach(), weights.detach(), keys.detach(), query_positions,
                                    int(top_k), int(window), starts)


def _check(queries, weights, keys, query_positions, starts):
    supported = _kernels().SUPPORTED_DTYPES
    for name, x in (("queries", queries), ("weights", weights), ("keys", keys)):
        if x.dtype not in supported:
            raise ValueError(f"{name} is {x.dtype}; the kernel takes {', '.join(map(str, supported))}")
    if queries.dim() != 4:
        raise ValueError(f"queries {tuple(queries.shape)}: expected [B, T, n_I, d_I]")
    b, t, n, d = queries.shape
    if tuple(weights.shape) != (b, t, n):
        raise ValueError(f"weights {tuple(weights.shape)}: expected [{b}, {t}, {n}] for queries {tuple(queries.shape)}")
    if keys.dim() != 3 or keys.shape[0] != b or keys.shape[2] != d:
        raise ValueError(f"keys {tuple(keys.shape)}: expected [{b}, S, {d}] for queries {tuple(queries.shape)}")
    if tuple(query_positions.shape) != (t,):
        raise ValueError(f"query_positions {tuple(query_positions.shape)}: expected [{t}]")
    if starts is not None and tuple(starts.shape) != (b,):
        raise ValueError(f"starts {tuple(starts.shape)}: expected [{b}]")
    devices = {x.device for x in (queries, weights, keys)}
    if len(devices) > 1:
        raise ValueError(f"inputs on several devices: {sorted(map(str, devices))}")
    if not _kernels().INTERPRETED and queries.device.type != "cuda":
        raise ValueError(f"inputs on {queries.device}: the compiled kernel needs CUDA tensors (or set TRITON_INTERPRET=1 "
                         "before importing triton to run it in the CPU interpreter)")


__all__ = ["MaskedScoresFunction", "fused_select_top_k", "masked_index_scores"]
