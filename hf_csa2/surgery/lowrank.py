"""Fit of a ``lowrank`` layer (:class:`~hf_csa2.model.lowrank_attention.LowRankKVAttention`):
rank-``r`` codes of the layer's own keys and values.

A projection ``y = W x + b`` (keys before QK-norm and RoPE, or values) is cut to rank ``r`` as
``y ~= U U^T (W x + b)`` with ``U`` [out, r] the top ``r`` eigenvectors of the second moment of
``y`` on calibration inputs, ``E[y y^T] = [W, b] E[x~ x~^T] [W, b]^T``: the rank-``r`` map with the
least mean squared error on those inputs (Eckart-Young on ``[W, b] M^{1/2}``), and the code
``c = U^T (W x + b)`` is what the cache holds (``down = U^T [W, b]``, ``up = U``).
"""

from __future__ import annotations

import torch
from torch import nn

from .linalg import augment, eigh


@torch.no_grad()
def output_pca_codes(proj: nn.Linear, moment: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, float]:
    """Rank-``rank`` code of ``proj``'s output under inputs with augmented second moment
    ``moment`` [d+1, d+1] (``E[x~ x~^T]``, ``x~ = [x, 1]``).

    Returns ``(down_weight [rank, d], down_bias [rank] or None, up_weight [out, rank], rel_err)``
    in ``proj``'s dtype, where ``rel_err = E||y - up(down(x))||^2 / E||y||^2`` on those inputs.
    """
    w = augment(proj.weight, proj.bias)  # [out, d+1]
    if not 1 <= rank <= w.shape[0]:
        raise ValueError(f"rank={rank}; allowed: 1..{w.shape[0]} (the projection's output width)")
    out_moment = w @ moment.double() @ w.T  # E[y y^T]
    vals, vecs = eigh(out_moment)
    u = vecs[:, -rank:]  # top `rank` directions
    total = vals.clamp_min(0).sum().clamp_min(1e-30)
    rel_err = float(vals[:-rank].clamp_min(0).sum() / total) if rank < len(vals) else 0.0
    down = u.T @ w
    down_w = down[:, :-1].to(proj.weight.dtype).contiguous()
    down_b = None if proj.bias is None else down[:, -1].to(proj.bias.dtype).contiguous()
    return down_w, down_b, u.to(proj.weight.dtype).contiguous(), rel_err


@torch.no_grad()
def fit_lowrank_layer(attn, src, moment: torch.Tensor) -> dict[str, float]:
    """Set ``attn``'s key/value codes (``k_down``/``k_up``, ``v_down``/``v_up``) from the dense
    layer ``src``'s ``k_proj``/``v_proj`` under the layer input moment ``moment`` [d+1, d+1].
    Returns the relative squared errors of the plain keys and the values on those inputs."""
    notes = {}
    for name, proj, down, up in (("key", src.k_proj, attn.k_down, attn.k_up), ("value", src.v_proj, attn.v_down, attn.v_up)):
        w_down, b_down, w_up, err = output_pca_codes(proj, moment, up.in_features)
        down.weight.copy_(w_down)
        if down.bias is not None:
            down.bias.copy_(b_down)
        up.weight.copy_(w_up)
        notes[f"lowrank_{name}_rel_err"] = err
    return notes


__all__ = ["fit_lowrank_layer", "output_pca_codes"]
