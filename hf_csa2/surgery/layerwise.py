"""Layer-by-layer calibration of a rewritten model against its source.

A one-shot rewrite of every layer from the SOURCE model's activations lets errors compound:
layer ``l`` of the converted model sees inputs already changed by layers ``< l``. Here the
converted model is run once over the whole calibration batch with a pre-hook on each
attention module; when layer ``l`` is reached, its inputs are the converted model's own, and
the hook fits that layer (e.g. merges KV heads from those inputs' statistics, then refits
``o_proj`` so the layer reproduces the SOURCE layer's attention output) before it runs. The
next layer then sees the corrected stream (GPTQ-style sequential calibration).

The whole calibration batch goes through in one forward, so its size is the memory knob.
"""

from __future__ import annotations

from typing import Callable

import torch

from .calibration import run_with_attention_hooks
from ..engine.held_out import BestState
from .linalg import solve_ridge_normal


@torch.no_grad()
def source_attention_outputs(model, windows: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's attention output (after ``o_proj``) on ``windows`` [N, T] -> [N, T, hidden]."""
    outputs: dict[int, torch.Tensor] = {}

    def make_hook(i):
        def hook(module, args, kwargs, output):
            outputs[i] = output[0].detach()

        return hook

    run_with_attention_hooks(model, windows, lambda i, attn: attn.register_forward_hook(make_hook(i), with_kwargs=True))
    return [outputs[i] for i in range(len(outputs))]


@torch.no_grad()
def calibrate_layerwise(model, windows: torch.Tensor, fit_layer: Callable) -> list:
    """Run ``model`` once on ``windows``; before layer ``i``'s attention runs, call
    ``fit_layer(i, attention_module, hidden_states [N, T, hidden], attention_kwargs)``, which
    may rewrite the module's weights in place. Returns the list of ``fit_layer`` results."""
    results: dict[int, object] = {}

    def make_hook(i):
        def hook(module, args, kwargs):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            results[i] = fit_layer(i, module, hidden, kwargs)

        return hook

    run_with_attention_hooks(model, windows, lambda i, attn: attn.register_forward_pre_hook(make_hook(i), with_kwargs=True))
    return [results[i] for i in range(len(results))]


@torch.no_grad()
def refit_output_projection(attn, hidden: torch.Tensor, attn_kwargs: dict, target: torch.Tensor,
                            ridge: float = 0.3) -> dict[str, float]:
    """Least-squares refit of ``attn.o_proj`` so the layer reproduces ``target`` [N, T, hidden].

    ``W = argmin ||A W^T - Y||^2 + lam ||W - W0||^2`` with ``A`` the attention output before
    ``o_proj`` [N*T, HQ*D] and ``lam = ridge * mean(diag(A^T A))``. Shrinking toward the current
    ``W0`` (not toward zero) matters: after a KV merge the columns of ``A`` are highly collinear
    (every query head mixes the same few value vectors), so ``A^T A`` is ill-conditioned.
    Returns the relative squared error before and after.
    """
    a, _ = attn.attention_output(hidden, attn_kwargs["position_embeddings"], attn_kwargs.get("attention_mask"))
    a = a.reshape(-1, a.shape[-1]).double()
    y = target.reshape(-1, target.shape[-1]).double()
    if attn.o_proj.bias is not None:
        y = y - attn.o_proj.bias.double()
    g, c, yy = a.T @ a, a.T @ y, (y * y).sum()
    w0 = attn.o_proj.weight.double()
    w = solve_ridge_normal(g, c, ridge, toward=w0.T).T

    def rel_err(wt):
        return (((wt @ g @ wt.T).trace() - 2 * (wt @ c).trace() + yy) / yy).item()

    before, after = rel_err(w0), rel_err(w)
    attn.o_proj.weight.copy_(w.to(attn.o_proj.weight.dtype))
    return {"rel_err_before": before, "rel_err_after": after}


def _take_windows(attn_kwargs: dict, idx: torch.Tensor, n: int) -> dict:
    """The attention kwargs for windows ``idx`` (tensors with a leading batch of ``n`` are indexed)."""

    def take(value):
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == n and n > 1:
            return value[idx]
        if isinstance(value, tuple):
            return tuple(take(v) for v in value)
        return value

    return {k: take(v) for k, v in attn_kwargs.items() if k in ("position_embeddings", "attention_mask")}


def refine_layer_output(attn, hidden: torch.Tensor, attn_kwargs: dict, target: torch.Tensor,
                        parameters: list[torch.nn.Parameter], *, steps: int = 100, lr: float = 1e-4,
                        batch: int = 4, holdout: int = 2, every: int = 10, seed: int = 0) -> dict[str, float]:
    """Gradient refinement of ``parameters`` so the layer reproduces ``target`` (after a closed-form init).

    Adam on the relative squared error ``|o_proj(attention_output(x)) - y|^2 / |y|^2`` over
    mini-batches of ``batch`` calibration windows (``hidden`` [N, T, hidden], ``target`` [N, T,
    hidden]); the last ``holdout`` windows are never used by the Adam steps and decide which
    state is kept (checked every ``every`` steps, the starting state included), so the
    refinement cannot make the layer worse on windows it did not train on (the closed-form
    init before it did see them). This is the non-linear objective the closed
    forms only approximate (the softmax between key error and output error).
    Returns the held-out relative error at the start and of the kept state, and the kept step.
    """
    n = hidden.shape[0]
    if not 0 < holdout < n:
        raise ValueError(f"holdout={holdout}; allowed: 1..{n - 1} (there are {n} calibration windows)")
    train, held = torch.arange(n - holdout), torch.arange(n - holdout, n)
    held_kwargs = _take_windows(attn_kwargs, held, n)

    def rel_err(idx, kwargs):
        a, _ = attn.attention_output(hidden[idx], kwargs["position_embeddings"], kwargs.get("attention_mask"))
        y = target[idx]
        return (attn.o_proj(a) - y).pow(2).sum() / y.pow(2).sum().clamp_min(1e-30)

    requires = [p.requires_grad for p in parameters]
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        kept = BestState(parameters, rel_err(held, held_kwargs).item())
    opt = torch.optim.Adam(parameters, lr=lr)
    try:
        for p in parameters:
            p.requires_grad_(True)
        for step in range(1, steps + 1):
            idx = train[torch.randperm(len(train), generator=gen)[:batch]]
            with torch.enable_grad():
                loss = rel_err(idx, _take_windows(attn_kwargs, idx, n))
                opt.zero_grad(set_to_none=True)
                loss.backward()
            opt.step()
            if step % every == 0 or step == steps:
                with torch.no_grad():
                    kept.offer(rel_err(held, held_kwargs).item(), step)
    finally:
        kept.restore()
        for p, req in zip(parameters, requires):
            p.requires_grad_(req)
    return {"refine_heldout_err_before": kept.start, "refine_heldout_err_after": kept.best, "refine_kept_step": kept.step}


__all__ = ["calibrate_layerwise", "refine_layer_output", "refit_output_projection", "source_attention_outputs"]
