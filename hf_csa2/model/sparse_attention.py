"""Reference sparse attention with sink logits: each query reads only the entries its index
lists name (Top-K addresses plus a local window), in ONE softmax.

A read may combine several *segments*, each with its own query projection, key/value store
and index list -- e.g. a CSA2 Reuse layer reads its source layer's latent entries (through
its own absorbed query) and its own sliding window of exact keys/values (through its plain
query). All segments share one softmax (and the sink): the weights over the union of the
selected entries sum to ``1 - a_sink``.

Memory and time are O(T * N * D) per head for N selected entries per query: the selected
keys/values are gathered, no T x S score matrix or mask is ever formed. fp32 softmax at
least; plain torch ops, so autograd works (gradients flow to queries, keys, values, sinks).

``path="scores"`` computes the same read another way: every query's logits against the whole
store (one matmul), then the selected ones picked out, and the read-out as a matmul with the
weights scattered back into the store's rows. O(T * S) memory, but on short stores (S a few
times N, e.g. calibration windows) much faster on CPU than gathering N entries of width D per
query. Same results to fp32 rounding (tested against each other).

Shapes (one segment):
    query  [B, T, H, Dk]       H query heads
    keys   [B, S, G, Dk]       G key groups, G divides H (head h reads group h // (H / G));
                               G = 1 for entries shared by every head (a latent)
    values [B, S, G', Dv]      G' divides H
    index  [B, T, N] long      positions in [0, S) to read; -1 = no entry (padding)
Result per segment: [B, T, H, Dv]. Rows with no entry at all (and no sink) read zeros.

Self-contained (torch only): copied next to converted weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SparseSegment:
    """One key/value store read through one query and one index list (shapes above)."""

    query: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    index: torch.Tensor


def gather_entries(store: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """store [B, S, G, D], index [B, T, N] (-1 allowed) -> [B, T, N, G, D] (padding reads entry 0)."""
    b, t, n = index.shape
    _, s, g, d = store.shape
    rows = index.clamp(min=0)
    # Whole rows by index_select, not an element-wise gather with an index expanded over G x D:
    # on CPU 2-3x faster (the index is read once per row, not once per element).
    if b == 1:  # any strides (a transposed [B, H, S, D] cache)
        return store[0].index_select(0, rows.reshape(-1)).view(b, t, n, g, d)
    if store.is_contiguous():
        rows = rows + torch.arange(b, device=index.device).view(b, 1, 1) * s
        return store.view(b * s, g * d).index_select(0, rows.reshape(-1)).view(b, t, n, g, d)
    return store[torch.arange(b, device=index.device).view(b, 1, 1), rows]


def grouped_read(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """weights [B, T, H, N], gathered values [B, T, N, G, Dv] -> [B, T, H, Dv]."""
    b, t, h, n = weights.shape
    g = values.shape[3]
    w = weights.view(b, t, g, h // g, n)
    return torch.einsum("btgrn,btngd->btgrd", w, values.to(weights.dtype)).reshape(b, t, h, -1)


def segment_logits(segment: SparseSegment, scaling: float, return_keys: bool = False):
    """Scaled logits [B, T, H, N] of one segment, -inf where the index is -1 (and, with
    ``return_keys``, the gathered keys [B, T, N, G, Dk])."""
    q = segment.query
    b, t, h, d = q.shape
    keys = gather_entries(segment.keys, segment.index)  # [B, T, N, G, Dk]
    g = keys.shape[3]
    logits = torch.einsum("btgrd,btngd->btgrn", q.view(b, t, g, h // g, d), keys).reshape(b, t, h, -1)
    logits = (logits * scaling).masked_fill(segment.index[:, :, None, :] < 0, float("-inf"))
    return (logits, keys) if return_keys else logits


def gathered_values(segment: SparseSegment, gathered_keys: torch.Tensor | None = None) -> torch.Tensor:
    """The values of a segment's entries [B, T, N, G, Dv]; when the values are the keys' leading
    columns (an absorbed latent store: keys ``[latent, 1, rope]``, values ``[latent, 1]``), a slice of
    the keys already gathered instead of a second gather."""
    if gathered_keys is not None and leading_columns(segment.values, segment.keys):
        return gathered_keys[..., : segment.values.shape[-1]]
    return gather_entries(segment.values, segment.index)


def leading_columns(values: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether ``values`` is a view of the first columns of ``keys`` (same rows, same strides)."""
    return (values.data_ptr() == keys.data_ptr() and values.stride() == keys.stride()
            and values.shape[:-1] == keys.shape[:-1] and values.shape[-1] <= keys.shape[-1])


def select_rows(store: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """store [B, S, ...] at rows [R] (dim 1) -> [B, R, ...]; a strided store (a view of a cache with
    spare rows) is indexed in place: index_select would first copy all of it."""
    return store.index_select(1, rows) if store.is_contiguous() else store[:, rows]


TORCH_READ_PATHS = ("gather", "scores")  # plain torch: run anywhere, any float dtype
READ_PATHS = ("auto",) + TORCH_READ_PATHS + ("triton",)


def scored_logits(segment: SparseSegment, scaling: float) -> torch.Tensor:
    """:func:`segment_logits` from the full score matrix: logits against every store row, then
    the indexed ones picked out ([B, T, H, N], -inf where the index is -1)."""
    q = segment.query
    b, t, h, d = q.shape
    g = segment.keys.shape[2]
    full = torch.einsum("btgrd,bsgd->btgrs", q.view(b, t, g, h // g, d), segment.keys).reshape(b, t, h, -1)
    index = segment.index.clamp(min=0)[:, :, None, :].expand(b, t, h, -1)
    return (full.gather(-1, index) * scaling).masked_fill(segment.index[:, :, None, :] < 0, float("-inf"))


def scattered_read(weights: torch.Tensor, segment: SparseSegment) -> torch.Tensor:
    """:func:`grouped_read` of the indexed values, as a matmul: weights [B, T, H, N] summed into
    their store rows (repeated indices add up; padding carries weight 0) -> [B, T, H, Dv]."""
    b, t, h, n = weights.shape
    values = segment.values
    s, g = values.shape[1], values.shape[2]
    index = segment.index.clamp(min=0)[:, :, None, :].expand(b, t, h, n)
    dense = weights.new_zeros(b, t, h, s).scatter_add_(-1, index, weights)
    out = torch.einsum("btgrs,bsgd->btgrd", dense.view(b, t, g, h // g, s), values.to(weights.dtype))
    return out.reshape(b, t, h, -1)


def sparse_sink_attention(
    segments: list[SparseSegment],
    *,
    scaling: float,
    sinks: torch.Tensor | None = None,
    return_weights: bool = False,
    query_block: int = 512,
    path: str = "gather",
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Softmax over the union of every segment's selected entries (plus the sink).

    Args:
        segments: the key/value stores to read (see the module docstring for shapes).
        scaling: logit scale applied to every ``q . k``.
        sinks: per-head sink logits [H] (seed 004 §1: ``exp(s_h)`` joins the denominator,
            nothing joins the numerator), or None.
        return_weights: also return the weights [B, T, H, sum N] (real entries only, in
            segment order; rows sum to ``1 - a_sink``).

        query_block: query rows (batch rows x positions) processed together; rows are
            independent, so blocks only bound the memory of the gathered entries
            (O(query_block * N * D), whatever the batch size).
        path: ``"auto"`` (:func:`auto_read_path`, per query block, on the store cut to the block's
            reads: :func:`crop_to_reads`), ``"gather"`` (the reference: gather the selected entries), ``"scores"`` (full
            logits then pick; see the module docstring) or ``"triton"`` (the fused kernel,
            :mod:`hf_csa2.kernels.sparse_read`, tested against this function; weights, when
            asked for, still come from "gather").

    Returns:
        (one output [B, T, H, Dv] per segment, weights or None). The layer's read-out is the
        sum of the segment outputs after each is mapped to a common space.
    """
    if path not in READ_PATHS:
        raise ValueError(f"path={path!r}; allowed: {', '.join(READ_PATHS)}")
    device = segments[0].query.device
    if uses_fused_kernels(path, device):
        if not return_weights:
            return _triton_read()(segments, scaling=scaling, sinks=sinks)
        path = "gather"  # the kernel never forms the weights
    b, t = segments[0].query.shape[:2]
    step = max(1, query_block // b)  # a batch of 8 would otherwise gather 8x the entries per block
    parts = []
    for i in range(0, t, step):
        block = [SparseSegment(s.query[:, i : i + step], s.keys, s.values, s.index[:, i : i + step])
                 for s in segments] if t > step else segments
        if path != "gather":  # a long store read by a few entries per query (a window): cut it to what is read
            width = sum(s.index.shape[-1] for s in block)
            # "auto" reads through "scores" only when the cut store is short: a longer cut is not worth its copy
            limit = SCORES_STORE_FACTOR * width if path == "auto" else None
            block = [crop_to_reads(s, limit) if s.keys.shape[1] > SCORES_STORE_FACTOR * s.index.shape[-1] else s
                     for s in block]
        block_path = path if path != "auto" else auto_read_path(
            device, False, store_rows=max(s.keys.shape[1] for s in block),
            index_width=sum(s.index.shape[-1] for s in block))
        parts.append(_sparse_block(block, scaling, sinks, return_weights, block_path))
    if len(parts) == 1:
        return parts[0]
    outputs = [torch.cat([p[0][k] for p in parts], dim=1) for k in range(len(segments))]
    return outputs, (torch.cat([p[1] for p in parts], dim=1) if return_weights else None)


def crop_to_reads(segment: SparseSegment, max_rows: int | None = None) -> SparseSegment:
    """The same read over a shorter store: keys/values cut to the rows ``segment.index`` names
    (in store order: a slice when they are one run), the index renumbered to match (-1 stays -1);
    the segment unchanged when more than ``max_rows`` rows are read (a batch of decode steps that
    each read their own Top-K rows: gathering them per query is cheaper than cutting the store).
    On a long prefill a block of queries that reads its window (and a few first tokens kept as
    attention sinks) touches about ``block + window`` rows, however long the prompt, which makes
    the ``scores`` path's matmul as cheap as the read itself."""
    real = segment.index >= 0
    # The rows read, ascending: marks in a store-sized mask (no sort of the T x N index, which
    # torch.unique would do).
    read = torch.zeros(segment.keys.shape[1], dtype=torch.bool, device=segment.index.device)
    read[segment.index[real]] = True
    rows = read.nonzero().flatten()
    if rows.numel() == 0:
        return SparseSegment(segment.query, segment.keys[:, :1], segment.values[:, :1], segment.index)
    if rows.numel() == segment.keys.shape[1] or (max_rows is not None and rows.numel() > max_rows):
        return segment
    lo, hi = int(rows[0]), int(rows[-1]) + 1
    if hi - lo == rows.numel():  # one run of rows: a view
        keys, values = segment.keys[:, lo:hi], segment.values[:, lo:hi]
        index = segment.index - lo
    else:
        keys = select_rows(segment.keys, rows)
        values = (keys[..., : segment.values.shape[-1]] if leading_columns(segment.values, segment.keys)
                  else select_rows(segment.values, rows))
        index = torch.searchsorted(rows, segment.index.clamp(min=0))
    return SparseSegment(segment.query, keys, values, torch.where(real, index, segment.index))


SCORES_STORE_FACTOR = 4  # "auto" reads through "scores" when a store has at most this many rows per index entry


def auto_read_path(device: torch.device, fused_runs: bool, store_rows: int | None = None,
                   index_width: int | None = None) -> str:
    """The read path ``"auto"`` stands for: the fused kernel for tensors on a CUDA device when it
    can run (``fused_runs``; on CPU the Triton interpreter is far slower than torch, so it is
    never chosen there); else ``"scores"`` when the store is short (``store_rows`` at most
    :data:`SCORES_STORE_FACTOR` times the ``index_width`` entries each query reads: one matmul
    beats gathering, e.g. training and calibration windows), else the reference ``"gather"``."""
    if device.type == "cuda" and fused_runs:
        return "triton"
    if store_rows is not None and index_width and store_rows <= SCORES_STORE_FACTOR * index_width:
        return "scores"
    return "gather"


def uses_fused_kernels(path: str, device: torch.device) -> bool:
    """Whether the read path ``path`` runs hf_csa2's Triton kernels for tensors on ``device``
    ("triton", or "auto" on CUDA where they can run); "triton" where they cannot run is
    refused with the fix. CSA2 layers score their indexers the same way as they read."""
    if path == "triton":
        _triton_read()
        return True
    return path == "auto" and device.type == "cuda" and _fused_read_runs()


def _fused_read_runs() -> bool:
    """Whether hf_csa2's fused read is importable and can run (False without hf_csa2: this file
    is also copied next to converted weights)."""
    try:
        from hf_csa2.kernels import available
    except ImportError:
        return False
    return available()


def _triton_read():
    """The fused kernel's entry point; it lives in hf_csa2 (this file is also copied next to
    converted weights, where hf_csa2 may be absent: then the path is refused with the fix)."""
    try:
        from hf_csa2.kernels import require_available
        from hf_csa2.kernels.sparse_read import sparse_sink_attention as fused
    except ImportError as err:
        raise ValueError(f"csa2_read_path='triton' needs the hf-csa2 package with Triton ({err}); pip install "
                         "'hf-csa2[triton]', or set csa2_read_path to 'gather' or 'scores'") from None
    require_available("sparse_read", "csa2_read_path='gather'")
    return fused


def _sparse_block(segments, scaling, sinks, return_weights, path="gather"):
    query = segments[0].query
    compute = torch.promote_types(query.dtype, torch.float32)
    gathered_keys = {}
    if path == "gather":
        logits = []
        for s in segments:
            z, gathered_keys[id(s)] = segment_logits(s, scaling, return_keys=True)
            logits.append(z.to(compute))
    else:
        logits = [scored_logits(s, scaling).to(compute) for s in segments]
    sizes = [z.shape[-1] for z in logits]
    z = torch.cat(logits, dim=-1)  # [B, T, H, N_total]
    if sinks is not None:
        sink = sinks.to(compute).view(1, 1, -1, 1).expand(*z.shape[:3], 1)
        z = torch.cat([z, sink], dim=-1)
    # Stable softmax that leaves all-masked rows at zero instead of NaN.
    peak = z.amax(dim=-1, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak)).detach()
    e = torch.exp(z - peak)
    denom = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(denom > 0, denom, torch.ones_like(denom))
    if sinks is not None:
        p = p[..., :-1]
    outputs = []
    for segment, w in zip(segments, p.split(sizes, dim=-1)):
        if path == "gather":
            values = gathered_values(segment, gathered_keys.get(id(segment)))
            read = grouped_read(w, values)  # gathered [B, T, N, G', Dv]
        else:
            read = scattered_read(w, segment)
        outputs.append(read.to(query.dtype))
    return outputs, (p.to(query.dtype) if return_weights else None)


def window_index(query_positions: torch.Tensor, window: int, first_position: int = 0) -> torch.Tensor:
    """Store rows of each query's own window: positions ``p - window + 1 .. p``.

    query_positions [T] (absolute); the store's row 0 holds absolute position
    ``first_position``. Returns [T, window] (ascending; -1 before the start of the store).
    """
    offsets = torch.arange(-window + 1, 1, device=query_positions.device)
    pos = query_positions[:, None] + offsets[None, :]
    return torch.where(pos >= first_position, pos - first_position, torch.full_like(pos, -1))


def drop_padding(index: torch.Tensor, starts: torch.Tensor | None, first_position: int = 0) -> torch.Tensor:
    """index [B, T, N] of store rows (row 0 = absolute position ``first_position``) with every
    entry before its batch row's first real position (``starts`` [B], left padding) set to -1."""
    if starts is None:
        return index
    return index.masked_fill(index + first_position < starts[:, None, None], -1)


__all__ = ["READ_PATHS", "TORCH_READ_PATHS", "SparseSegment", "auto_read_path", "uses_fused_kernels", "drop_padding", "gather_entries", "gathered_values", "grouped_read", "scattered_read", "scored_logits", "segment_logits",
           "sparse_sink_attention", "window_index"]
