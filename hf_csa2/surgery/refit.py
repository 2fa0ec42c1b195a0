"""Least-squares refit of each layer's output projection after an attention rewrite.

For layer ``l`` let ``Y`` be the SOURCE attention's output and ``A`` the rewritten attention's
output before ``o_proj``, both computed from the source model's own hidden states on the
calibration windows. ``W_O <- argmin ||A W^T - Y||^2`` (ridge-regularised) is a closed-form
regression that corrects whatever the rewrite lost in the read-out (merged keys change the
attention pattern, merged values the mixed vectors). Only Gram matrices are accumulated:
``G = A^T A`` [HQ*D, HQ*D] and ``C = A^T Y`` [HQ*D, hidden], in float64.
"""

from __future__ import annotations

import torch

from .calibration import decoder_layers


@torch.no_grad()
def refit_output_projections(source_model, new_model, windows: torch.Tensor, *, ridge: float = 1e-4,
                             batch_size: int = 2) -> dict[str, float]:
    """Refit ``o_proj`` of every ``Csa2Attention`` layer of ``new_model`` in place.

    Args:
        source_model: the unconverted model (defines the target outputs and the inputs).
        new_model: a ``Csa2ForCausalLM`` with the same number of layers.
        windows: calibration token ids [N, T].
        ridge: Tikhonov weight relative to the mean diagonal of ``G``.
    Returns:
        relative squared error of the attention outputs, summed over layers, before/after.
    """
    src_layers, new_layers = decoder_layers(source_model), decoder_layers(new_model)
    stats: dict[int, dict[str, torch.Tensor]] = {}

    def make_hook(i):
        attn = new_layers[i].self_attn

        def hook(module, args, kwargs, output):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            a, _ = attn.attention_output(hidden, kwargs["position_embeddings"], kwargs.get("attention_mask"))
            y = output[0]
            if attn.o_proj.bias is not None:
                y = y - attn.o_proj.bias
            a = a.reshape(-1, a.shape[-1]).double()
            y = y.reshape(-1, y.shape[-1]).double()
            s = stats.setdefault(i, {"G": 0.0, "C": 0.0, "yy": 0.0})
            s["G"] = s["G"] + a.T @ a
            s["C"] = s["C"] + a.T @ y
            s["yy"] = s["yy"] + (y * y).sum()

        return hook

    handles = [layer.self_attn.register_forward_hook(make_hook(i), with_kwargs=True) for i, layer in enumerate(src_layers)]
    try:
        for start in range(0, windows.shape[0], batch_size):
            source_model(input_ids=windows[start : start + batch_size], use_cache=False)
    finally:
        for h in handles:
            h.remove()

    def rel_error(w, s):  # ||A W^T - Y||^2 / ||Y||^2 from the Gram matrices
        return ((w @ s["G"] @ w.T).trace() - 2 * (w @ s["C"]).trace() + s["yy"]) / s["yy"]

    before = after = 0.0
    for i, s in stats.items():
        o_proj = new_layers[i].self_attn.o_proj
        w_old = o_proj.weight.double()
        g = s["G"]
        reg = ridge * g.diagonal().mean().clamp_min(1e-12) * torch.eye(g.shape[0], dtype=torch.float64)
        w_new = torch.linalg.solve(g + reg, s["C"]).T  # [hidden, HQ*D]
        before += rel_error(w_old, s).item()
        after += rel_error(w_new, s).item()
        o_proj.weight.copy_(w_new.to(o_proj.weight.dtype))
    n = max(len(stats), 1)
    return {"attn_out_rel_err_before_refit": before / n, "attn_out_rel_err_after_refit": after / n}


__all__ = ["refit_output_projections"]
