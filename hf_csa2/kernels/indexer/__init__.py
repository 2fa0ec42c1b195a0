"""The indexer's masked scores as Triton kernels (issue "Kernels", item 2b).

Reference (the specification, tested against): :func:`hf_csa2.model.indexer.masked_scores`,
``score(t, j) = sum_h w_h(x_t) * ReLU(q^I_h(x_t) . k^I_j)`` with -inf where ``j`` may not be
picked (``j > p_t - W``, or left padding). The kernel sums the index heads inside one tile
(no [T, n_I, S] dots in memory) and skips tiles wholly in the causal future. The Top-K on
its scores is fused too (:func:`fused_select_top_k`, what ``Indexer.select(..., fused=True)``
runs): each query block streams over key blocks keeping its K best selection keys (the score's
ordered bits and the position, as :func:`hf_csa2.model.indexer.top_k_earliest_first` builds
them, so ties break the same way), so the [T, S] scores are never written. Forward and backward (queries, head weights, keys); fp32 arithmetic.

Shapes: queries [B, T, n_I, d_I], weights [B, T, n_I], keys [B, S, d_I], query_positions [T],
starts [B] or None -> scores [B, T, S] fp32.
"""

from __future__ import annotations

from .. import KernelUnavailableError, available
from .op import MaskedScoresFunction, fused_select_top_k, masked_index_scores

__all__ = ["KernelUnavailableError", "MaskedScoresFunction", "available", "fused_select_top_k", "masked_index_scores"]
