"""Sink-logit surgery: give every query head a learnable sink logit ``s_h`` (seed 004 §1).

The real-token weights become ``exp(z_j) / (exp(s_h) + Z)``; the output is the dense output
times ``g = sigmoid(logsumexp(z) - s_h)``. A converted model must first behave exactly like
its source, so ``s_h`` starts ``margin`` nats below the smallest logsumexp seen on
calibration text. On SmolLM2 the smallest held-out logsumexp per head was up to 5.2 nats
below the calibration one, and fp32 rounding of any gate below 1.0 is amplified to ~1e-4 in
the logits by 30 layers; ``margin=24`` keeps ``g == 1.0`` exactly there (bit-identical
logits), ``margin=20`` did not (6.6e-5): ``python scripts/sink_margin_check.py``.

Trade-off, stated plainly: the sink gradient is proportional to the sink's weight
``exp(s - lse)``, so at an exact init it is ~e^-24 of its value at an open sink; ``-1e4``
would make it exactly zero. To train sinks, first open them with
``calibrate_sinks(model, windows, margin=m)`` for a small ``m`` (a few nats: visible but small
effect), then fine-tune.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.modeling_hf_csa2 import SINK_OFF, AttentionBase
from ..model.sink_attention import masked_logits
from .calibration import run_with_attention_hooks
from .plan import SinksPlan
from .rebuild import is_csa2, native_specs, to_csa2


def add_sinks(model):
    """Return a copy of ``model`` with a sink logit per query head in every layer, set to
    ``SINK_OFF`` (outputs unchanged); see :func:`calibrate_sinks` for a trainable start."""
    specs = [dict(s) for s in (model.config.attention_layers if is_csa2(model) else native_specs(model.config))]
    for spec in specs:
        spec["sinks"] = True
    return to_csa2(model, specs)


@torch.no_grad()
def min_logsumexp_per_head(model, windows: torch.Tensor, batch_size: int = 2) -> dict[int, torch.Tensor]:
    """Smallest per-head logsumexp of the real-token logits over all calibration queries.

    Args:
        model: a ``Csa2ForCausalLM``.
        windows: token ids [N, T].
    Returns:
        ``{layer_idx: tensor [HQ]}`` (float64).
    """
    found: dict[int, torch.Tensor] = {}

    def hook(module: AttentionBase, args, kwargs, _output):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        q, k = module.scoring_qk(hidden, kwargs["position_embeddings"])
        logits, allowed = masked_logits(q.double(), k.double(), kwargs.get("attention_mask"),
                                        scaling=module.scaling, softcap=module.softcap)
        lse = torch.logsumexp(logits, dim=-1)  # [B, HQ, T]
        empty_row = ~allowed.any(dim=-1).expand_as(lse)  # e.g. left padding: no real query there
        lse = lse.masked_fill(empty_row, float("inf")).amin(dim=(0, 2))  # [HQ]
        prev = found.get(module.layer_idx)
        found[module.layer_idx] = lse if prev is None else torch.minimum(prev, lse)

    run_with_attention_hooks(
        model, windows, lambda i, attn: attn.register_forward_hook(hook, with_kwargs=True), batch_size
    )
    return found


@torch.no_grad()
def calibrate_sinks(model, windows: torch.Tensor, margin: float = 24.0) -> dict[str, float]:
    """Set every sink to ``min_lse - margin`` (see module doc). Returns summary numbers."""
    lse = min_logsumexp_per_head(model, windows)
    values = []
    for module in model.modules():
        if isinstance(module, AttentionBase) and module.sinks is not None:
            target = lse[module.layer_idx] - margin
            module.sinks.copy_(target.clamp_min(SINK_OFF).to(module.sinks.dtype))
            values.append(module.sinks.detach().double())
    allv = torch.cat(values) if values else torch.zeros(1)
    return {"sink_min": allv.min().item(), "sink_max": allv.max().item(), "margin": margin}


@dataclass
class SinksFitReport:
    """What :func:`apply_sinks` did: the plan, and with ``init: calibrated`` the range of the
    sink logits it set (None with ``init: off``)."""

    plan: SinksPlan
    sink_min: float | None = None
    sink_max: float | None = None

    def stage_notes(self) -> dict:
        notes: dict = {"init": self.plan.init}
        if self.sink_min is not None:
            notes.update(sink_min=self.sink_min, sink_max=self.sink_max, margin=self.plan.margin)
        return notes


#: calibration windows the sink init reads (the smallest logsumexp settles within a few)
SINK_CALIBRATION_WINDOWS = 4


def apply_sinks(model, plan: SinksPlan, *, windows: torch.Tensor | None = None) -> tuple[object, SinksFitReport]:
    """:func:`add_sinks`, then (``init: calibrated``) :func:`calibrate_sinks` on the first
    :data:`SINK_CALIBRATION_WINDOWS` of ``windows`` [N, T] with ``plan.margin``."""
    new = add_sinks(model)
    report = SinksFitReport(plan=plan)
    if plan.init == "calibrated":
        if windows is None:
            raise ValueError("sinks init='calibrated' needs calibration windows")
        found = calibrate_sinks(new, windows[:SINK_CALIBRATION_WINDOWS], plan.margin)
        report.sink_min, report.sink_max = found["sink_min"], found["sink_max"]
    return new, report


__all__ = ["SinksFitReport", "add_sinks", "apply_sinks", "calibrate_sinks", "min_logsumexp_per_head"]
