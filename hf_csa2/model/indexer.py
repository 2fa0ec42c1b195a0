"""Lightning indexer (DeepSeek-V3.2 DSA / V4.1 style): picks each query's Top-K entries.

    score(t, j) = sum_h w_h(x_t) * ReLU(q^I_h(x_t) . k^I_j)

One index key ``k^I_j`` per token (shared by the index heads, cached by the layer that owns
the entries), ``n_I`` index heads with queries ``q^I_h`` and weights ``w_h`` computed from the
reading layer's input. RoPE may act on some index dims: ``rope_pairs`` lists frequency pairs
of the model's rotary table; the first ``2 * len(rope_pairs)`` dims of every index head carry
them (half-split layout), the rest are position-free.

Selection is causal and leaves out the reader's own window: query ``t`` picks among
positions ``j <= t - window`` (the window ``t - window + 1 .. t`` is read anyway), so the
union Top-K + window never holds a position twice. Missing picks (short prefixes) are -1.
Ties go to the earlier position.

Block-level selection (NSA / HSI style, ``block`` = B > 1): positions are cut into blocks of B
(aligned to the row's first real position), each scored by its best selectable position; the
``K / B`` best blocks are read whole (their selectable positions, in order), so a read is
``K / B`` contiguous runs of the store.

Self-contained (torch only): copied next to converted weights.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention_base import rotate_half


def top_k_earliest_first(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [..., k] of the ``k`` largest fp32 ``scores`` [..., S], largest first, ties to the
    earlier position: what a stable descending sort gives (ties, e.g. ReLU zeros, must break the
    same way whatever S is, or a prefill and a chunked prefill would read different entries), at
    the cost of ``topk``. Each score becomes an int64 key: its order-preserving integer image in
    the high 32 bits, ``S - 1 - position`` in the low ones, so all keys differ."""
    # + 0.0 turns -0.0 into +0.0 (a sort counts them equal; their bit patterns differ)
    bits = (scores.to(torch.float32) + 0.0).contiguous().view(torch.int32).to(torch.int64)
    ordered = torch.where(bits >= 0, bits, -(bits & 0x7FFFFFFF) - 1)  # IEEE order as integers
    s = scores.shape[-1]
    position = torch.arange(s - 1, -1, -1, device=scores.device)
    return ((ordered << 32) | position).topk(k, dim=-1).indices


def top_blocks_earliest_first(scores: torch.Tensor, k: int, block: int,
                              starts: torch.Tensor | None = None) -> torch.Tensor:
    """Positions [B, T, (k // block) * block] of the ``k // block`` blocks of ``block`` positions
    whose largest fp32 score (of ``scores`` [B, T, S]) is largest, best block first, ties to the
    earlier block, each block's positions in order. Blocks are aligned to each row's first real
    position (``starts`` [B], 0 when None), so a left-padded row picks what it picks alone; the
    last block may run past ``S - 1`` (the caller drops those and unselectable positions)."""
    s = scores.shape[-1]
    blocks = -(-s // block)
    offset = torch.zeros((), dtype=torch.long, device=scores.device) if starts is None else starts.view(-1, 1, 1)
    pos = offset + torch.arange(blocks * block, device=scores.device)  # [B|1, 1, blocks * block]
    aligned = scores.float().gather(-1, pos.clamp(max=s - 1).expand(*scores.shape[:-1], -1))
    aligned = aligned.masked_fill(pos >= s, float("-inf"))
    best = aligned.unflatten(-1, (blocks, block)).amax(dim=-1)  # [B, T, blocks]
    chosen = top_k_earliest_first(best, min(k // block, blocks))  # [B, T, m]
    first = chosen[..., None] * block + offset[..., None]  # [B, T, m, 1]
    return (first + torch.arange(block, device=scores.device)).flatten(-2)


class Indexer(nn.Module):
    """Index queries/weights of one layer, and the index keys when the layer owns entries.

    Parameters: ``wq`` [n_I * d_I, hidden], ``weights_proj`` [n_I, hidden] (+bias: a constant
    head weight is the training-free init) and, with
    ``with_key``, ``wk`` [d_I, hidden].
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, rope_pairs: list[int], rotary_dim: int,
                 with_key: bool, dtype=None):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.rope_pairs = sorted(int(i) for i in rope_pairs)
        self.rotary_dim = rotary_dim  # width D of the model's cos/sin tables
        self.wq = nn.Linear(hidden_size, num_heads * head_dim, bias=False, dtype=dtype)
        self.weights_proj = nn.Linear(hidden_size, num_heads, bias=True, dtype=dtype)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False, dtype=dtype) if with_key else None

    def _rotate(self, x: torch.Tensor, position_embeddings) -> torch.Tensor:
        """x [B, T, G, d_I] with RoPE applied to its first 2n dims at ``rope_pairs``."""
        if not self.rope_pairs:
            return x
        half = self.rotary_dim // 2
        dims = self.rope_pairs + [i + half for i in self.rope_pairs]
        cos, sin = position_embeddings
        cos, sin = cos[..., dims][:, :, None], sin[..., dims][:, :, None]  # [B, T, 1, 2n]
        n2 = len(dims)
        rot, rest = x[..., :n2], x[..., n2:]
        return torch.cat([rot * cos + rotate_half(rot) * sin, rest], dim=-1)

    def keys(self, hidden_states: torch.Tensor, position_embeddings) -> torch.Tensor:
        """hidden_states [B, T, hidden] -> index keys [B, T, d_I]."""
        k = self.wk(hidden_states)[:, :, None]
        return self._rotate(k, position_embeddings)[:, :, 0]

    def queries(self, hidden_states: torch.Tensor, position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden_states [B, T, hidden] -> (index queries [B, T, n_I, d_I], head weights [B, T, n_I])."""
        b, t, _ = hidden_states.shape
        q = self.wq(hidden_states).view(b, t, self.num_heads, self.head_dim)
        return self._rotate(q, position_embeddings), self.weights_proj(hidden_states)

    def scores(self, queries: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Index scores [B, T, S] of queries [B, T, n_I, d_I] (weights [B, T, n_I]) against keys [B, S, d_I]."""
        return index_scores(queries, weights, keys)

    def select(self, queries: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
               query_positions: torch.Tensor, top_k: int, window: int, chunk: int = 256,
               starts: torch.Tensor | None = None, fused: bool = False, block: int = 0) -> torch.Tensor:
        """Top-K positions [B, T, K] (-1 = none) among ``j <= t - window`` for each query.

        queries [B, T, n_I, d_I] at absolute positions query_positions [T]; keys [B, S, d_I]
        at positions 0..S-1; ``starts`` [B]: each row's first real position (left padding is
        never picked), or None. Processed in chunks of queries so memory stays O(chunk * S).
        ``fused``: score and select in hf_csa2's Triton kernel (``hf_csa2.kernels.indexer``)
        instead of torch; the same selection rule (it equals this on the kernel's scores).
        ``block`` > 1: block-level selection (module docstring; with ``fused``, the kernel's
        scores and torch's block pick).
        """
        if fused and block <= 1:
            return _fused_ops()[0](queries, weights, keys, query_positions, top_k, window, starts)
        scores = _fused_ops()[1] if fused else masked_scores
        return select_top_k(queries, weights, keys, query_positions, top_k, window, chunk, starts, scores, block)


def index_scores(queries: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``sum_h w_h * ReLU(q_h . k_j)``: queries [B, T, n_I, d_I], weights [B, T, n_I], keys
    [B, S, d_I] -> scores [B, T, S] fp32."""
    dots = torch.einsum("btnd,bsd->btns", queries.float(), keys.float()).relu_()
    return torch.einsum("btns,btn->bts", dots, weights.float())


def masked_scores(queries: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, query_positions: torch.Tensor,
                  window: int, starts: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`index_scores` [B, T, S] fp32 with -inf where position ``j`` may not be picked by
    the query at ``query_positions[t]``: ``j > t - window`` (its window, or the future) or
    ``j < starts[b]`` (left padding; ``starts`` [B] or None)."""
    s = keys.shape[1]
    j = torch.arange(s, device=keys.device)
    allowed = (j[None, :] <= query_positions[:, None] - window)[None]  # [1, T, S]
    if starts is not None:
        allowed = allowed & (j[None, None, :] >= starts[:, None, None])
    return index_scores(queries, weights, keys).masked_fill(~allowed, float("-inf"))


def select_top_k(queries: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, query_positions: torch.Tensor,
                 top_k: int, window: int, chunk: int = 256, starts: torch.Tensor | None = None,
                 scores=masked_scores, block: int = 0) -> torch.Tensor:
    """:meth:`Indexer.select` with the scoring function ``scores`` (same signature as
    :func:`masked_scores`): Top-K positions [B, T, top_k], -1 where fewer are selectable.
    ``block`` > 1: the ``top_k // block`` best aligned blocks, read whole
    (:func:`top_blocks_earliest_first`)."""
    b, t = queries.shape[:2]
    s = keys.shape[1]
    # block selection reads whole blocks: k // block of them, fewer while there are fewer
    k = min(top_k // block, -(-s // block)) * block if block > 1 else min(top_k, s)
    out = []
    for start in range(0, t, chunk):
        stop = min(start + chunk, t)
        sc = scores(queries[:, start:stop], weights[:, start:stop], keys, query_positions[start:stop], window,
                    starts)  # [B, c, S]
        if block > 1:
            idx = top_blocks_earliest_first(sc, top_k, block, starts)  # [B, c, k], may run past S - 1
            val = sc.gather(-1, idx.clamp(max=s - 1)).masked_fill(idx >= s, float("-inf"))
        else:
            idx = top_k_earliest_first(sc, k)  # [B, c, k]
            val = sc.gather(-1, idx)
        out.append(torch.where(torch.isfinite(val), idx, torch.full_like(idx, -1)))
    idx = torch.cat(out, dim=1) if out else queries.new_empty((b, 0, k), dtype=torch.long)
    if k < top_k:  # fewer entries than K so far: pad
        idx = torch.cat([idx, idx.new_full((b, t, top_k - k), -1)], dim=-1)
    return idx


def _fused_ops():
    """(the Triton kernel of :func:`select_top_k` on fused scores, the kernel of
    :func:`masked_scores`); they live in hf_csa2 (this file is also copied
    next to converted weights, where hf_csa2 may be absent: then the path is refused)."""
    try:
        from hf_csa2.kernels.indexer import fused_select_top_k, masked_index_scores
    except ImportError as err:
        raise ValueError(f"the fused indexer needs the hf-csa2 package with Triton ({err}); pip install "
                         "'hf-csa2[triton]', or set csa2_read_path to 'gather' or 'scores'") from None
    return fused_select_top_k, masked_index_scores


__all__ = ["Indexer", "index_scores", "masked_scores", "select_top_k", "top_blocks_earliest_first",
           "top_k_earliest_first"]
