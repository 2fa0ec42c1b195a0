"""Exact merge of segment-wise softmax reads into one softmax (torch, differentiable).

Segment i read alone gives ``o_i = sum_j exp(z_j - lse_i) v_j`` over its own entries. The joint
softmax over every segment's entries plus the sink has log-denominator
``lse_total = logsumexp(lse_1, ..., lse_K, s_h)`` and reads
``sum_i exp(lse_i - lse_total) * o_i``: segment i's share of the mass times its own read.
The sink joins ``lse_total`` only, so the shares sum to ``1 - a_sink``.
"""

from __future__ import annotations

import torch


def merge_segments(
    outputs: list[torch.Tensor], lses: list[torch.Tensor], sinks: torch.Tensor | None = None
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Weight each segment's normalised read by its share of the joint softmax.

    Args:
        outputs: per segment, o_i [B, T, H, Dv_i] (normalised within the segment; zeros where
            the segment has no entry).
        lses: per segment, lse_i [B, T, H] (-inf where the segment has no entry).
        sinks: per-head sink logits [H], or None.

    Returns:
        (per segment ``exp(lse_i - lse_total) * o_i`` [B, T, H, Dv_i], lse_total [B, T, H]).
        Rows where every lse and the sink are -inf get zeros and lse_total = -inf, with finite
        (zero) gradients: no ``exp(-inf - -inf)`` is ever formed.
    """
    z = torch.stack(lses, dim=-1)  # [B, T, H, K]
    if sinks is not None:
        z = torch.cat([z, sinks.to(z.dtype).view(1, 1, -1, 1).expand(*z.shape[:3], 1)], dim=-1)
    # the peak only shifts for stability (its gradient cancels); 0 stands in for an all -inf row
    peak = z.amax(dim=-1).detach()
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    mass = torch.exp(z - peak[..., None]).sum(dim=-1)
    some = mass > 0
    lse_total = torch.where(some, peak + torch.log(torch.where(some, mass, torch.ones_like(mass))),
                            torch.full_like(mass, float("-inf")))
    shift = torch.where(some, lse_total, torch.zeros_like(lse_total))
    merged = [torch.exp(lse - shift)[..., None] * o for lse, o in zip(lses, outputs)]
    return merged, lse_total


__all__ = ["merge_segments"]
