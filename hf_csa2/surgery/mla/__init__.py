"""MLA surgery: rewrite dense (MHA/GQA/MQA) attention into multi-head latent attention.

The layer caches a latent ``c = W_DKV x`` plus a small rope key; keys and values are
up-projections of the latent (DeepSeek-V2/V3's MLA). Converting a dense layer takes two
decisions, each in its own module:

* :mod:`.rope_slots` -- what keeps RoPE: per-head pairs, or a rope key shared by all KV heads
  whose slots mix the heads per frequency (RoRoPE-style PCA), scored by the attention-weighted
  logit damage (``perturbation``) or MHA2MLA's 2-norm (``norm``);
* :mod:`.factorisation` -- the latent: an activation- and readout-weighted factorisation of the
  position-free key rows and value rows (or plain weight SVD), and DeepSeek-V3's latent norm.

:mod:`.apply` runs both layer by layer (:func:`apply_mla`) from the plan's ``mla`` section.
"""

from .apply import MlaFitReport, MlaLayerFit, apply_mla, choose_splits, mla_specs
from .factorisation import (
    BALANCE_GRID,
    factorise_kv,
    full_stack_width,
    refit_up_projection,
    scale_anchor,
    stacked_kv_rows,
)
from .rope_slots import (
    ROPE_CRITERIA,
    RopeScores,
    RopeSplit,
    choose_rope_split,
    head_mixing,
    layer_rope_scores,
    pre_rope_qk,
    rope_component_scores,
    score_rope_slots,
    split_from_scores,
    split_key_rows,
    uniform_frequency_counts,
)

__all__ = ["BALANCE_GRID", "ROPE_CRITERIA", "MlaFitReport", "MlaLayerFit", "RopeScores", "RopeSplit", "apply_mla",
           "choose_rope_split", "choose_splits", "factorise_kv", "full_stack_width", "head_mixing", "layer_rope_scores",
           "mla_specs", "pre_rope_qk", "refit_up_projection", "rope_component_scores", "scale_anchor", "score_rope_slots",
           "split_from_scores", "split_key_rows", "stacked_kv_rows", "uniform_frequency_counts"]
