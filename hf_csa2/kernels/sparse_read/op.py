"""Autograd wrapper of the one-segment kernels and the public multi-segment read."""

from __future__ import annotations

import torch

from .. import require_available
from .merge import merge_segments
# the reference's torch paths (hf_csa2.model.sparse_attention.TORCH_READ_PATHS; a test checks they agree):
# both run the kernel here. Not imported: kernels sit below the model layer, which dispatches to them.
READ_PATHS = ("gather", "scores")
_REFERENCE = "hf_csa2.model.sparse_attention.sparse_sink_attention"


def _kernels():
    # Triton is imported on first use only, so this package imports without it
    from . import kernel

    return kernel


class SparseReadFunction(torch.autograd.Function):
    """One segment's (o fp32 [B, T, H, Dv], lse fp32 [B, T, H]); differentiable in query, keys
    and values through both outputs."""

    @staticmethod
    def forward(ctx, query, keys, values, index, scaling, block_n):
        o, lse = _kernels().sparse_read_forward(query, keys, values, index, scaling, block_n)
        ctx.save_for_backward(query, keys, values, index, o, lse)
        ctx.scaling, ctx.block_n = scaling, block_n
        return o, lse

    @staticmethod
    def backward(ctx, d_o, d_lse):
        query, keys, values, index, o, lse = ctx.saved_tensors
        d_o = torch.zeros_like(o) if d_o is None else d_o
        d_lse = torch.zeros_like(lse) if d_lse is None else d_lse
        dq, dk, dv = _kernels().sparse_read_backward(query, keys, values, index, o, lse, d_o, d_lse,
                                                     ctx.scaling, ctx.block_n)
        return dq, dk, dv, None, None, None


def sparse_read(query, keys, values, index, scaling: float, block_n: int | None = None):
    """One segment: query [B, T, H, Dk], keys [B, S, G, Dk], values [B, S, G', Dv], index
    [B, T, N] long (-1 = no entry) -> (o [B, T, H, Dv] fp32, normalised over the segment's
    entries, zeros where there are none; lse [B, T, H] fp32, -inf there). Differentiable.

    An index outside [-1, S) is read as padding (the reference raises): checking would cost a
    device sync per call, and a kernel must not read out of bounds."""
    require_available("sparse_read", _REFERENCE)
    _check_segment(query, keys, values, index)
    return SparseReadFunction.apply(query, keys, values, index, float(scaling), block_n)


def sparse_sink_attention(
    segments,
    *,
    scaling: float,
    sinks: torch.Tensor | None = None,
    return_weights: bool = False,
    query_block: int = 512,
    path: str = "gather",
) -> tuple[list[torch.Tensor], None]:
    """The Triton version of :func:`hf_csa2.model.sparse_attention.sparse_sink_attention`: one
    softmax over the union of every segment's selected entries plus the sink.

    Args:
        segments: ``SparseSegment``-like objects with ``query`` [B, T, H, Dk_i], ``keys``
            [B, S_i, G_i, Dk_i], ``values`` [B, S_i, G'_i, Dv_i], ``index`` [B, T, N_i] long
            (-1 = no entry); G_i and G'_i divide H.
        scaling: logit scale applied to every ``q . k``.
        sinks: per-head sink logits [H] (``exp(s_h)`` joins the denominator only), or None.
        return_weights: must be False: the kernel never forms the weights.
        query_block: accepted for the reference's signature; unused (the kernel's memory does not
            grow with the number of queries read together).
        path: ``"gather"`` or ``"scores"``, checked as the reference does; both run the kernel.

    Returns:
        (one output [B, T, H, Dv_i] per segment in the first query's dtype, None). Rows with no
        entry and no sink read zeros. Differentiable in every query, key, value and the sinks.
    """
    if return_weights:
        raise ValueError(f"return_weights=True: the Triton sparse read never forms the weights; they are only "
                         f"available from the reference, {_REFERENCE}")
    if path not in READ_PATHS:
        raise ValueError(f"path={path!r}; allowed: {', '.join(READ_PATHS)}")
    if not segments:
        raise ValueError("sparse_sink_attention needs at least one segment")
    require_available("sparse_sink_attention", _REFERENCE)
    b, t, h, _ = segments[0].query.shape
    for i, s in enumerate(segments):
        if tuple(s.query.shape[:3]) != (b, t, h):
            raise ValueError(f"segment {i}: query {tuple(s.query.shape)} does not share [B, T, H] = {[b, t, h]} "
                             "with segment 0")
    if sinks is not None and tuple(sinks.shape) != (h,):
        raise ValueError(f"sinks {tuple(sinks.shape)}: expected one logit per head, [{h}]")
    reads = [sparse_read(s.query, s.keys, s.values, s.index, scaling) for s in segments]
    merged, _ = merge_segments([o for o, _ in reads], [lse for _, lse in reads], sinks)
    dtype = segments[0].query.dtype
    return [o.to(dtype) for o in merged], None


def _check_segment(query, keys, values, index):
    supported = _kernels().SUPPORTED_DTYPES
    for name, x in (("query", query), ("keys", keys), ("values", values)):
        if x.dim() != 4:
            raise ValueError(f"{name} {tuple(x.shape)}: expected 4 dims (see the shapes in hf_csa2.kernels.sparse_read)")
        if x.dtype not in supported:
            raise ValueError(f"{name} is {x.dtype}; the kernel takes {', '.join(map(str, supported))}")
    b, t, h, d_k = query.shape
    if keys.shape[0] != b or keys.shape[3] != d_k or h % keys.shape[2]:
        raise ValueError(f"keys {tuple(keys.shape)} do not fit query {tuple(query.shape)}: expected [{b}, S, G, {d_k}] "
                         f"with G dividing {h}")
    if values.shape[0] != b or values.shape[1] != keys.shape[1] or h % values.shape[2]:
        raise ValueError(f"values {tuple(values.shape)} do not fit keys {tuple(keys.shape)}: expected "
                         f"[{b}, {keys.shape[1]}, G', Dv] with G' dividing {h}")
    if index.dim() != 3 or tuple(index.shape[:2]) != (b, t) or index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"index {tuple(index.shape)} {index.dtype}: expected [{b}, {t}, N] long")
    devices = {x.device for x in (query, keys, values, index)}
    if len(devices) > 1:
        raise ValueError(f"inputs on several devices: {sorted(map(str, devices))}")
    if not _kernels().INTERPRETED and query.device.type != "cuda":
        raise ValueError(f"inputs on {query.device}: the compiled kernel needs CUDA tensors (or set TRITON_INTERPRET=1 "
                         "before importing triton to run it in the CPU interpreter)")


__all__ = ["READ_PATHS", "SparseReadFunction", "sparse_read", "sparse_sink_attention"]
