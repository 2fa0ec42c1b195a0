"""``apply_mla``: rewrite a model's dense layers into MLA layers following an :class:`MlaPlan`.

Per layer: choose what keeps RoPE (:mod:`.rope_slots`), then factorise the latent
(:mod:`.factorisation`). Layers are fitted one after another on the converted model's own
inputs (:mod:`..layerwise`), then ``o_proj`` is refitted to the source layer's output and,
when asked, refined by Adam steps on the layer's output error. The fit results come back as an
:class:`MlaFitReport`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ...model.configuration_hf_csa2 import attention_head_dim
from ..calibration import decoder_layers, run_with_attention_hooks
from ..gqa import has_qk_norm
from ..layerwise import calibrate_layerwise, refine_layer_output, refit_output_projection, source_attention_outputs
from ..linalg import augmented_moment
from ..plan import MlaPlan
from ..rebuild import is_csa2, native_specs, to_csa2
from .factorisation import BALANCE_GRID, balance_blocks, base_balance, block_diag_weight, set_latent
from .rope_slots import RopeScores, RopeSplit, layer_inv_freq, layer_rope_scores, split_from_scores, uniform_frequency_counts


@dataclass
class MlaLayerFit:
    """How one layer's latent was fitted on calibration data (relative squared errors of the
    layer's attention output against the source layer's)."""

    balance: float  # the K/V balance factor picked from BALANCE_GRID (times the energy-equalising base)
    rel_err: float  # after the factorisation, before the o_proj refit
    rel_err_before: float | None = None  # o_proj refit (plan.refit_output): before and after
    rel_err_after: float | None = None
    refine_heldout_err_before: float | None = None  # Adam refinement (plan.refine_steps), on held-out windows
    refine_heldout_err_after: float | None = None
    refine_kept_step: int | None = None  # the refinement step whose state was kept (0: the start)


@dataclass
class MlaFitReport:
    """What :func:`apply_mla` did: the plan it followed, each layer's RoPE decision and, per
    layer, its fit (None where nothing was fitted on calibration data: ``init: weight_svd``, or
    a layer outside ``only_layers``)."""

    plan: MlaPlan
    rope_splits: list[RopeSplit | None]  # None: a layer outside only_layers
    layers: list[MlaLayerFit | None]

    def fitted(self) -> list[MlaLayerFit]:
        return [f for f in self.layers if f is not None]

    def stage_notes(self) -> dict:
        """The MLA stage report's notes (the pipeline adds ``weight_svd_calib_ppl``): the
        plan's choices and the fits' mean errors."""
        plan = self.plan
        notes: dict = {"init": plan.init, "rope_key": plan.rope_key, "rope_criterion": plan.rope_criterion}
        fits = self.fitted()
        if fits:
            notes["attn_out_rel_err_before_refit"] = sum(f.rel_err for f in fits) / len(fits)
            if plan.refit_output:
                notes["attn_out_rel_err_after_refit"] = sum(f.rel_err_after for f in fits) / len(fits)
            if plan.refine_steps:
                for key in ("refine_heldout_err_before", "refine_heldout_err_after"):
                    notes[key] = sum(getattr(f, key) for f in fits) / len(fits)
        return notes


def mla_specs(specs: list[dict], rank: int, splits: list[RopeSplit], latent_norm: bool = False) -> list[dict]:
    """Turn dense specs into MLA specs (same KV-head count and sinks)."""
    return [{"kind": "mla", "num_key_value_heads": s["num_key_value_heads"], "kv_lora_rank": rank,
             "rope_pairs": split.pairs, "sinks": s.get("sinks", False), "latent_norm": latent_norm}
            for s, split in zip(specs, splits)]


@torch.no_grad()
def apply_mla(model, plan: MlaPlan, *, windows: torch.Tensor | None = None, splits: list[RopeSplit] | None = None,
              only_layers: list[int] | None = None):
    """Return ``(copy of model with MLA layers, MlaFitReport)``; ``model``: native or hf_csa2
    with dense layers.

    ``plan`` (the plan's ``mla`` section) gives the latent width ``kv_lora_rank``, the rope key
    width ``qk_rope_head_dim`` (``qk_rope_head_dim / 2`` complex slots per KV head, or in total
    for a ``shared`` key whose slots mix the KV heads per frequency), how the slots are chosen
    (``rope_criterion``), the factorisation (``init``), ``latent_norm`` / ``uniform_rope`` (the
    DeepSeek-V3 layout), the ``o_proj`` refit (``refit_output``, ``ridge``) and the Adam
    refinement after it (``refine_steps``, ``refine_lr``: all the layer's parameters, the state
    kept is the best on held-out calibration windows).

    Args:
        windows: calibration token ids [N, T]; needed unless ``init`` is ``weight_svd`` and every
            pair keeps RoPE (or ``splits`` are given).
        splits: explicit per-layer RoPE decisions (override ``rope_criterion``).
        only_layers: convert only these layers (e.g. the full layers of a CSA2 plan); the others
            stay dense and unchanged.
    Raises:
        PlanError: the plan does not fit the model (rank above the exact rank, rope key too
            wide, a shared rope key over several QK-normalised key heads).
    """
    if not isinstance(plan, MlaPlan):
        raise TypeError(f"apply_mla takes an MlaPlan (the plan's mla section), got {type(plan).__name__}")
    cfg = model.config
    specs = [dict(s) for s in (cfg.attention_layers if is_csa2(model) else native_specs(cfg))]
    if any(s["kind"] != "dense" for s in specs):
        raise ValueError("MLA surgery needs dense attention layers as input")
    d = attention_head_dim(cfg)
    qk_norm = has_qk_norm(model)
    for s in specs:
        plan.check_geometry(s["num_key_value_heads"], d, getattr(cfg, "base_model_type", cfg.model_type) if qk_norm else None)
    layers = decoder_layers(model)
    converted = set(range(len(layers)) if only_layers is None else only_layers)
    if not converted <= set(range(len(layers))):
        raise ValueError(f"only_layers={sorted(converted)}; allowed: layer indices 0..{len(layers) - 1}")
    if plan.init == "activation_aware" and windows is None:
        raise ValueError("init='activation_aware' needs calibration windows")
    shared, num_pairs = plan.rope_key == "shared", plan.qk_rope_head_dim // 2

    if splits is None:
        if num_pairs == d // 2 and not shared:
            splits = [RopeSplit([list(range(d // 2))] * s["num_key_value_heads"]) for s in specs]
        else:
            if windows is None:
                raise ValueError("choosing the rope slots needs calibration windows")
            splits = choose_splits(model, windows[:4], plan, converted)
    new_specs = [mla_specs([s], plan.kv_lora_rank, [splits[i]], plan.latent_norm)[0] if i in converted else s
                 for i, s in enumerate(specs)]
    new = to_csa2(model, new_specs)
    new_layers = decoder_layers(new)

    if plan.init == "weight_svd":
        for i, layer in enumerate(new_layers):
            if i in converted:
                set_latent(layer.self_attn, layers[i].self_attn, splits[i], plan.kv_lora_rank)
        return new, MlaFitReport(plan, splits, [None] * len(new_layers))
    targets = source_attention_outputs(model, windows)

    def fit_layer(i, attn, hidden, attn_kwargs) -> MlaLayerFit | None:
        if i not in converted:
            return None
        moment = augmented_moment(hidden)
        src = layers[i].self_attn
        gain = attn._key_gain(torch.arange(d)) if qk_norm else None
        kb, vb = balance_blocks(src, hidden, src.o_proj.weight.detach(), attn.nope_dims, attn.rope_of_kv,
                                attn.num_key_value_heads, gain)
        base = base_balance(kb, vb)
        best = None
        for mult in BALANCE_GRID if attn.nope_width else (1.0,):
            set_latent(attn, src, splits[i], plan.kv_lora_rank, moment, block_diag_weight(kb, vb, base * mult), hidden)
            # Not attn(...): that would re-enter this very pre-hook.
            a, _ = attn.attention_output(hidden, attn_kwargs["position_embeddings"], attn_kwargs.get("attention_mask"))
            err = ((attn.o_proj(a) - targets[i]).pow(2).sum() / targets[i].pow(2).sum()).item()
            if best is None or err < best[0]:
                best = (err, mult)
        set_latent(attn, src, splits[i], plan.kv_lora_rank, moment, block_diag_weight(kb, vb, base * best[1]), hidden)
        fit = MlaLayerFit(balance=best[1], rel_err=best[0])
        if plan.refit_output:
            fit = dataclasses.replace(fit, **refit_output_projection(attn, hidden, attn_kwargs, targets[i], ridge=plan.ridge))
        if plan.refine_steps:
            fit = dataclasses.replace(fit, **refine_layer_output(attn, hidden, attn_kwargs, targets[i], list(attn.parameters()),
                                                                 steps=plan.refine_steps, lr=plan.refine_lr))
        return fit

    return new, MlaFitReport(plan, splits, calibrate_layerwise(new, windows, fit_layer))


def choose_splits(model, windows: torch.Tensor, plan: MlaPlan, only_layers: set[int] | None = None) -> list[RopeSplit | None]:
    """Each layer's RoPE decision from the source's queries/keys on ``windows`` [N, T]
    (``plan.uniform_rope``: the same frequencies in every layer, each layer mixing its own heads);
    None for layers outside ``only_layers`` (not scored: the score is the costly part)."""
    d = attention_head_dim(model.config)
    shared, num_pairs = plan.rope_key == "shared", plan.qk_rope_head_dim // 2
    scored: list[RopeScores | None] = [None] * len(decoder_layers(model))

    def make_hook(i):
        def hook(attn, args, kwargs):
            if only_layers is not None and i not in only_layers:
                return
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            scored[i] = layer_rope_scores(attn, hidden, layer_inv_freq(model, i, d), shared, plan.rope_criterion)

        return hook

    run_with_attention_hooks(model, windows, lambda i, a: a.register_forward_pre_hook(make_hook(i), with_kwargs=True))
    counts = uniform_frequency_counts([sc for sc in scored if sc is not None], num_pairs) if plan.uniform_rope else None
    return [None if sc is None else split_from_scores(sc, num_pairs, shared, counts) for sc in scored]


__all__ = ["MlaFitReport", "MlaLayerFit", "apply_mla", "choose_splits", "mla_specs"]
