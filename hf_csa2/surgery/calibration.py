"""Calibration statistics gathered from the source model on real text.

Everything the inits need is a second moment of a layer's attention input, so one pass
over the calibration windows suffices: ``E[x~ x~^T]`` with ``x~ = [x, 1]`` (the constant
coordinate carries projection biases through the same algebra).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .linalg import augmented_moment


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a supported causal LM (``model.model.layers``)."""
    return model.model.layers


@torch.no_grad()
def run_with_attention_hooks(model: nn.Module, windows: torch.Tensor, attach: Callable, batch_size: int | None = None) -> None:
    """Run ``model`` over ``windows`` [N, T] (in batches of ``batch_size``; all at once if None)
    with ``attach(layer_idx, attention_module) -> hook handle`` applied to every layer first;
    the hooks are removed afterwards whatever happens."""
    handles = [attach(i, layer.self_attn) for i, layer in enumerate(decoder_layers(model))]
    was_training = model.training
    model.eval()
    try:
        step = batch_size or windows.shape[0]
        decoder = getattr(model, "model", model)  # the decoder stack only: the hooks never need logits
        for start in range(0, windows.shape[0], step):
            decoder(input_ids=windows[start : start + step], use_cache=False)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()


@torch.no_grad()
def attention_input_moments(model: nn.Module, windows: torch.Tensor, batch_size: int = 4) -> list[torch.Tensor]:
    """Per-layer second moments of the attention input, augmented with a constant 1.

    Args:
        model: a causal LM whose layers call ``self_attn(hidden_states=...)``.
        windows: token ids [N, T].
    Returns:
        one float64 tensor [d+1, d+1] per decoder layer: ``mean over tokens of x~ x~^T``.
    """
    layers = decoder_layers(model)
    d = model.config.hidden_size
    sums = [torch.zeros(d + 1, d + 1, dtype=torch.float64) for _ in layers]
    counts = [0 for _ in layers]
    def make_hook(i):
        def hook(module, args, kwargs):
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            n = x.shape[:-1].numel()
            sums[i] += augmented_moment(x) * n
            counts[i] += n

        return hook

    run_with_attention_hooks(
        model, windows, lambda i, attn: attn.register_forward_pre_hook(make_hook(i), with_kwargs=True), batch_size
    )
    return [s / max(c, 1) for s, c in zip(sums, counts)]


__all__ = ["attention_input_moments", "decoder_layers", "run_with_attention_hooks"]
