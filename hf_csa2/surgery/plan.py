"""Declarative conversion plans: typed dataclasses mirrored by YAML presets in conversion/.

A plan says WHAT to build; the pipeline decides how. Every field is typed and bounded
(pydantic validates it: real booleans, finite numbers, sizes within limits, no unknown keys),
and the checks across fields run right after, so a bad plan fails with one line naming the
field and its allowed values before any model is loaded.

Example (conversion/smollm2-mqa.yaml)::

    gqa:
      num_key_value_heads: 1
      init: calibrated
    calibration:
      text: python-docs:calib
      num_tokens: 8192
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import field
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

import yaml
from pydantic import Field, TypeAdapter, ValidationError, model_validator
from pydantic.dataclasses import dataclass
from pydantic_core import ArgsKwargs

from ..errors import UserError
from ..typed_config import (
    CONFIG,
    Bool,
    Text,
    allowed,
    check_keys,
    describe,
    doc,
    field_info,
    field_names,
    int_in,
    number_in,
    read_yaml_file,
    set_fields as set_typed_fields,
    unwrap as _unwrap,
    yaml_hint as _yaml_hint,
)
from ..model.configuration_hf_csa2 import (
    CSA2_MODES,
    QK_NORM_BASE_MODEL_TYPES,
    attention_head_dim,
)
from ..engine.trainer import TRAINABLE as DISTILL_TRAINABLE

GQA_INITS = ("calibrated", "mean")
MLA_INITS = ("activation_aware", "weight_svd")
MLA_ROPE_KEYS = ("shared", "per_head")
MLA_ROPE_CRITERIA = ("perturbation", "norm")
SINK_INITS = ("calibrated", "off")
DTYPES = ("float32", "bfloat16", "float16")
CSA2_OTHER_MODES = ("reuse", "reindex", "swa")
# A plan's layer modes: the CSA2 modes, and `lowrank` (the layer reads every position from
# rank-r codes of its own keys and values: a kind of its own in config.json, not a csa2 mode).
CSA2_PLAN_MODES = (*CSA2_MODES, "lowrank")

# Upper bounds: far above anything these models use, low enough that a typo (1e11 tokens,
# a 2^60 top-k) is refused at once instead of failing after minutes of work.
MAX_HEADS = 4096
MAX_WIDTH = 1 << 16  # latent / rope widths
MAX_TOKENS = 1 << 31  # calibration / distillation text
MAX_SEQ = 1 << 20  # window, top_k, seq_len, context
MAX_STEPS = 10_000_000
MAX_RIDGE = 1e6


class PlanError(UserError, ValueError):
    """A plan field has a bad value; the message names the field and the allowed values."""


_int = int_in
_number = number_in
_doc = doc
_CONFIG = CONFIG


@dataclass(config=_CONFIG)
class GqaPlan:
    """Reduce every layer to ``num_key_value_heads`` KV heads (1 = MQA), or every layer but ``keep_layers``."""

    num_key_value_heads: Annotated[_int(1, MAX_HEADS), _doc("KV heads per layer after the merge (1 = MQA); must divide the query heads")]
    init: Annotated[Literal[GQA_INITS], _doc("\"calibrated\": RoPE-aware weighted PCA merge; \"mean\": Ainslie et al. mean-pooling")] = "calibrated"
    refit_output: Annotated[Bool, _doc("with \"calibrated\": least-squares refit of o_proj to the source's attention output")] = True
    ridge: Annotated[_number(MAX_RIDGE), _doc("refit regularisation toward the merged o_proj, relative to mean diag(A^T A)")] = 0.3
    refine_steps: Annotated[_int(0, MAX_STEPS), _doc("with \"calibrated\": then Adam steps per layer on its output error (q/k/v/o; best state on held-out windows kept)")] = 0
    refine_lr: Annotated[_number(1.0), _doc("Adam learning rate of refine_steps")] = 1e-4
    keep_layers: Annotated[Optional[Annotated[list[_int(0, MAX_HEADS)], Field(min_length=1, max_length=MAX_HEADS)]], _doc(
        "layers (0-based) left with the source's KV heads, unmerged (a mixed plan: the layers whose merge costs most; "
        "the result is an hf_csa2 checkpoint, not a native one); None: every layer merged")] = None

    def __post_init__(self):
        if self.refine_steps and self.init != "calibrated":
            raise PlanError("gqa.refine_steps needs init: calibrated (mean is the calibration-free baseline)")
        if self.keep_layers is not None and len(set(self.keep_layers)) != len(self.keep_layers):
            repeated = sorted({i for i in self.keep_layers if self.keep_layers.count(i) > 1})
            raise PlanError(f"gqa.keep_layers repeats layer(s) {repeated}; allowed: each layer index once")


@dataclass(config=_CONFIG)
class MlaPlan:
    """Rewrite every layer into multi-head latent attention.

    Cache per token and layer: ``kv_lora_rank + qk_rope_head_dim`` (+ one key scale per KV head
    for QK-norm sources); ``qk_rope_head_dim`` is the width of the rope key (shared) or of each
    KV head's rope key (per_head).
    """

    kv_lora_rank: Annotated[_int(1, MAX_WIDTH), _doc("width of the latent cached per token and layer")]
    qk_rope_head_dim: Annotated[_int(0, MAX_WIDTH), _doc("width of the rope key that stays rotated (even: RoPE rotates pairs)")]
    rope_key: Annotated[Literal[MLA_ROPE_KEYS], _doc("\"shared\": one rope key mixing the KV heads per frequency; \"per_head\": one per KV head")] = "shared"
    rope_criterion: Annotated[Literal[MLA_ROPE_CRITERIA], _doc("which frequencies keep RoPE: attention-weighted logit damage, or MHA2MLA's 2-norm")] = "perturbation"
    init: Annotated[Literal[MLA_INITS], _doc("latent factorisation: covariance/readout-weighted, or plain weight SVD")] = "activation_aware"
    latent_norm: Annotated[Bool, _doc("RMS-normalise the latent (DeepSeek-V3 kv_a_layernorm; needed for export)")] = False
    uniform_rope: Annotated[Bool, _doc("the same rope frequencies in every layer (one rope table; needed for export)")] = False
    compare_weight_svd: Annotated[Bool, _doc("also score the plain weight-SVD init in the stage report")] = True
    refit_output: Annotated[Bool, _doc("least-squares refit of o_proj to the source's attention output")] = True
    ridge: Annotated[_number(MAX_RIDGE), _doc("o_proj refit regularisation, relative to mean diag(A^T A)")] = 0.3
    refine_steps: Annotated[_int(0, MAX_STEPS), _doc("then Adam steps per layer on its output error (best state on held-out windows kept)")] = 0
    refine_lr: Annotated[_number(1.0), _doc("Adam learning rate of refine_steps")] = 1e-4

    @model_validator(mode="before")
    @classmethod
    def _drop_removed_fields(cls, data: Any) -> Any:
        """Plans saved before 0.2 (``hf_csa2_plan.yaml`` next to a checkpoint) write every field,
        the removed ones as ``false``: those are dropped; any other value is refused."""
        kwargs = (data.kwargs or {}) if isinstance(data, ArgsKwargs) else data
        if not isinstance(kwargs, dict) or not kwargs.keys() & MLA_REMOVED_FIELDS.keys():
            return data
        kept = {}
        for name, value in kwargs.items():
            if name not in MLA_REMOVED_FIELDS:
                kept[name] = value
            elif value is not False:
                shown = str(value).lower() if isinstance(value, bool) else repr(value)
                raise PlanError(f"mla.{name}={shown}: removed in 0.2 ({MLA_REMOVED_FIELDS[name]}); allowed: false "
                                "(as older plans wrote it) or leave it out")
        return ArgsKwargs(data.args, kept) if isinstance(data, ArgsKwargs) else kept

    def check_geometry(self, num_key_value_heads: int, head_dim: int, qk_norm: str | None = None) -> None:
        """Checks against a layer with ``num_key_value_heads`` KV heads of width ``head_dim``;
        ``qk_norm``: the source's model type when it normalises each key head (else None)."""
        kv, d = num_key_value_heads, head_dim
        mixed = self.rope_key == "shared" and kv > 1
        if mixed and qk_norm:
            raise PlanError(
                f"mla.rope_key='shared' with {kv} KV heads needs a source without QK-norm ({qk_norm} "
                "normalises each key head separately); allowed here: rope_key: per_head, or gqa.num_key_value_heads: 1"
            )
        max_rope = kv * d if mixed else d
        if self.qk_rope_head_dim > max_rope:
            raise PlanError(f"mla.qk_rope_head_dim={self.qk_rope_head_dim}; allowed: 0..{max_rope} (even) for this model")
        nope = d if mixed else d - self.qk_rope_head_dim
        exact = kv * (nope + d)
        if self.kv_lora_rank > exact:
            raise PlanError(
                f"mla.kv_lora_rank={self.kv_lora_rank} exceeds {exact}, the width of the stacked position-free "
                f"keys and values ({kv} KV heads); allowed: 1..{exact}"
            )

    def __post_init__(self):
        if self.qk_rope_head_dim % 2:
            raise PlanError(f"mla.qk_rope_head_dim={self.qk_rope_head_dim}; allowed: an even number (RoPE rotates pairs)")
        if self.init == "weight_svd":
            for name in ("refine_steps", "latent_norm"):
                if getattr(self, name):
                    raise PlanError(f"mla.{name} needs init: activation_aware (weight_svd is the calibration-free baseline)")


#: MlaPlan fields removed in 0.2 and why (docs/results.md: SmolLM2 at 1/4 of its KV cache, held-out
#: ppl ratio 2.570 with the defaults).
MLA_REMOVED_FIELDS = {
    "averaged_values": "measured worse than the default: held-out ppl ratio 2.634 vs 2.570",
    "drop_fast_terms": "measured no real gain over the default: held-out ppl ratio 2.538 vs 2.570",
    "uneven_ranks": "measured worse than the default: held-out ppl ratio 3.089 vs 2.570",
}


@dataclass(config=_CONFIG)
class Csa2Plan:
    """Rewrite the model into CSA2 shared-KV sparse layers (needs the ``mla`` section when a layer
    is full: it says how full layers build their shared latent entries).

    The layer plan is either ``layers`` (one mode per layer: full, reindex, reuse, swa, lowrank) or
    ``full_every: k`` (full at layers 0, k, 2k, ... and ``other_mode`` elsewhere). Reindex
    layers read the nearest earlier full layer, reuse layers the nearest earlier full or
    reindex layer. Each read attends Top-K (``top_k``) plus the layer's own ``window``.
    """

    layers: Annotated[Optional[Annotated[list[Literal[CSA2_PLAN_MODES]], Field(min_length=1, max_length=MAX_HEADS)]],
                      _doc("one mode per layer (or give full_every)")] = None
    full_every: Annotated[Optional[_int(1, MAX_HEADS)], _doc("full at layers 0, k, 2k, ... and other_mode elsewhere (or give layers)")] = None
    other_mode: Annotated[Literal[CSA2_OTHER_MODES], _doc("with full_every: the mode of the other layers")] = "reuse"
    window: Annotated[_int(1, MAX_SEQ), _doc("tokens each layer reads exactly, its own last ones")] = 128
    top_k: Annotated[_int(1, MAX_SEQ), _doc("older entries the indexer selects per query")] = 256
    select_block: Annotated[Optional[_int(2, MAX_SEQ)], _doc(
        "block-level selection: positions cut into aligned blocks of this many, each scored by its best position, the "
        "top_k / select_block best blocks read whole (contiguous reads; must divide top_k); None: token-level Top-K")] = None
    sinks: Annotated[Optional[Bool], _doc("None: keep each layer's own (e.g. from the sinks stage)")] = None
    sink_tokens: Annotated[_int(0, MAX_SEQ), _doc("non-full layers also keep the first N tokens exactly (StreamingLLM attention sinks)")] = 0
    index_head_dim: Annotated[Optional[_int(2, MAX_WIDTH)], _doc(
        "width of the index key cached per token (even: RoPE pairs); None: the attention head width (the indexer starts "
        "exactly as the source's attention logits); narrower: the frequency pairs with the most query-key energy keep "
        "RoPE, leaving cache for a wider latent")] = None
    refine_entry_bias: Annotated[Bool, _doc("move each head's entry bias to minimise its read-out error (down to off)")] = False
    reader_ridge: Annotated[_number(MAX_RIDGE), _doc("reader least squares, relative to mean diag(C^T C)")] = 1e-3
    exact_window: Annotated[Bool, _doc(
        "full layers read their own last `window` tokens from exact keys/values (a constant-size ring, as every other "
        "layer does) and their latent entries only for Top-K far reads; o_proj then restarts from the source's and "
        "follows refit_output")] = False
    lowrank_key_rank: Annotated[Optional[_int(1, MAX_WIDTH)], _doc(
        "lowrank layers: width of the code each token's own key (before RoPE) is cached as; None: half the layer's "
        "key width (num_key_value_heads x head_dim)")] = None
    lowrank_value_rank: Annotated[Optional[_int(1, MAX_WIDTH)], _doc(
        "lowrank layers: width of the code of each token's own value; None: the full value width (exact values)")] = None
    refit_output: Annotated[Bool, _doc("o_proj of reindex/reuse/swa/lowrank layers (and exact_window full layers) refit to the source's attention output")] = True
    indexer_warmup_steps: Annotated[_int(0, MAX_STEPS), _doc("KL warm-up of full/reindex indexers to the dense attention (0 = training-free only)")] = 100

    def __post_init__(self):
        if self.select_block is not None and self.top_k % self.select_block:
            raise PlanError(f"csa2.select_block={self.select_block} does not divide csa2.top_k={self.top_k}: whole "
                            f"blocks are read; allowed: a divisor of {self.top_k} >= 2, or null")

    def layer_modes(self, num_layers: int) -> list[str]:
        if self.layers is not None:
            return list(self.layers)
        return ["full" if i % self.full_every == 0 else self.other_mode for i in range(num_layers)]


def default_sources(modes: list[str]) -> list[int | None]:
    """Each reindex layer reads the nearest earlier full layer; each reuse layer the nearest
    earlier full or reindex layer (its Top-K); full/swa layers read nothing."""
    sources: list[int | None] = []
    for i, mode in enumerate(modes):
        wanted = {"reindex": ("full",), "reuse": ("full", "reindex")}.get(mode)
        if wanted is None:
            sources.append(None)
            continue
        earlier = [j for j in range(i) if modes[j] in wanted]
        if not earlier:
            raise ValueError(f"layer {i}: mode={mode!r} needs an earlier {' or '.join(wanted)} layer; "
                             f"the plan's first layers are {modes[: i + 1]}")
        sources.append(earlier[-1])
    return sources


@dataclass(config=_CONFIG)
class SinksPlan:
    """Add one learnable sink logit per query head."""

    init: Annotated[Literal[SINK_INITS], _doc("\"calibrated\": just below every calibration row's logsumexp; \"off\": -1e4")] = "calibrated"
    margin: Annotated[_number(1e4, positive=False), _doc("calibrated sinks sit this far (in nats) below the smallest logsumexp seen")] = 24.0


@dataclass(config=_CONFIG)
class DistillPlan:
    """After the surgery stages: AdamW (no weight decay, no clipping) on KL(source || converted)
    of the next-token distributions over calibration windows (the source's predictions are the
    only targets), on the training engine of ``hf-csa2 train`` (a transformers ``Trainer``).

    ``num_tokens`` of calibration text (in windows of ``calibration.seq_len``, after the
    report's scoring windows) of which the last ``holdout`` windows are never trained on and
    decide which state is kept (the converted start included).
    """

    steps: Annotated[_int(1, MAX_STEPS), _doc("optimizer steps")] = 200
    lr: Annotated[_number(1.0), _doc("AdamW learning rate (constant)")] = 1e-4
    batch: Annotated[_int(1, MAX_HEADS), _doc("windows per step")] = 4
    num_tokens: Annotated[_int(1, MAX_TOKENS), _doc("calibration tokens to distill on (held-out windows included)")] = 32768
    holdout: Annotated[_int(1, MAX_HEADS), _doc("windows never trained on that pick the kept state")] = 4
    every: Annotated[_int(1, MAX_STEPS), _doc("held-out check every N steps")] = 10
    trainable: Annotated[Literal[DISTILL_TRAINABLE], _doc("\"attention\": only the rewritten attention modules; \"all\": all but embeddings/head")] = "attention"


@dataclass(config=_CONFIG)
class CalibrationPlan:
    """Text used to fit inits and to score each stage."""

    text: Annotated[Text, _doc("a file/folder, or a named corpus (python-docs:calib)")] = "python-docs:calib"
    num_tokens: Annotated[_int(1, MAX_TOKENS), _doc("calibration tokens the fits use")] = 8192
    seq_len: Annotated[_int(2, MAX_SEQ), _doc("tokens per calibration window")] = 512
    eval_windows: Annotated[_int(0, MAX_HEADS), _doc("windows of seq_len scored after each stage (report ppl)")] = 4
    answer_probes: Annotated[_int(0, 64), _doc(
        "probes per depth (far: 5% into a scoring window, near: its last 10%) of the answer check run on the "
        "source and after each stage: a fact planted in the window, asked back at its end; 0: off")] = 6


SURGERY_SECTIONS = ("gqa", "mla", "sinks", "csa2")


@dataclass(config=_CONFIG)
class ConversionPlan:
    """A full conversion: optional GQA/MQA, optional MLA, optional sinks, optional CSA2, optional
    distillation toward the source, calibration settings (stages run in that order).

    ``context`` is the context length the converted model is meant for: the stage report
    counts KV-cache elements per token at it (windowed layers hold a fixed number of tokens,
    so the figure depends on the context).
    """

    gqa: Optional[GqaPlan] = None
    mla: Optional[MlaPlan] = None
    sinks: Optional[SinksPlan] = None
    csa2: Optional[Csa2Plan] = None
    distill: Optional[DistillPlan] = None
    calibration: CalibrationPlan = field(default_factory=CalibrationPlan)
    dtype: Annotated[Literal[DTYPES], _doc("dtype the source is loaded in and the result saved in")] = "float32"
    context: Annotated[_int(1, MAX_SEQ), _doc("context length the converted model is meant for (the KV cost is counted at it)")] = 8192

    def __post_init__(self):
        self.validate()

    # -- construction -------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "ConversionPlan":
        """Build and validate a plan from its YAML mapping (``sinks: true`` means default sinks)."""
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise PlanError(f"a plan must be a mapping of sections ({', '.join(field_names(cls))}), got {data!r}")
        check_keys(data, "plan", PlanError, "plan")
        data = dict(data)
        if data.get("sinks") is True:
            data["sinks"] = {}
        elif data.get("sinks") is False:
            data["sinks"] = None
        if "calibration" in data and data["calibration"] is None:  # `calibration:` left empty: the defaults
            del data["calibration"]
        try:
            return _ADAPTER.validate_python(data)
        except ValidationError as err:
            raise PlanError(describe(err, ConversionPlan, "plan")) from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> "ConversionPlan":
        """Read a plan file; an empty (or comment-only) file is refused."""
        data = read_yaml_file(path, PlanError, "plan", "conversion/")
        if data is None:
            raise PlanError(f"plan file {str(path)!r} is empty; it needs at least one of the sections "
                            f"{', '.join(SURGERY_SECTIONS)} (see conversion/)")
        if not isinstance(data, dict):
            raise PlanError(f"plan file {str(path)!r} must hold a mapping of sections, got {type(data).__name__}")
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    # -- validation -----------------------------------------------------------------------
    def validate(self) -> None:
        """Checks across fields that need no model (each field's type and range is already
        checked by its annotation)."""
        cal = self.calibration
        if cal.num_tokens < cal.seq_len:
            raise PlanError(
                f"calibration.num_tokens={cal.num_tokens} is below calibration.seq_len={cal.seq_len}; "
                "allowed: num_tokens >= seq_len"
            )
        for name in ("gqa", "mla"):
            self._validate_refine(name)
        if self.csa2 is not None:
            self._validate_csa2()
        if self.gqa is not None and self.gqa.keep_layers and (self.mla is not None or self.csa2 is not None):
            raise PlanError("gqa.keep_layers (layers with other KV heads than the rest) cannot be combined with mla or "
                            "csa2, which need one KV geometry for every layer; allowed: keep_layers with gqa (+ sinks, "
                            "distill) only, or null")
        if self.distill is not None:
            self._validate_distill()

    def _validate_refine(self, section: str) -> None:
        stage = getattr(self, section)
        fit_windows = self.calibration.num_tokens // self.calibration.seq_len
        if stage is not None and stage.refine_steps and fit_windows < 3:
            raise PlanError(f"{section}.refine_steps needs at least 3 calibration windows (2 are held out to pick the kept "
                            f"state); calibration.num_tokens={self.calibration.num_tokens} / seq_len="
                            f"{self.calibration.seq_len} gives {fit_windows}")

    def _validate_distill(self) -> None:
        d = self.distill
        if self.is_noop_surgery:
            raise PlanError("distill needs a surgery stage before it (gqa, mla, sinks or csa2): there is nothing to distill")
        windows = d.num_tokens // self.calibration.seq_len
        if windows <= d.holdout:
            raise PlanError(f"distill.num_tokens={d.num_tokens} gives {windows} windows of calibration.seq_len="
                            f"{self.calibration.seq_len}, not more than distill.holdout={d.holdout}; allowed: "
                            f"num_tokens >= {(d.holdout + 1) * self.calibration.seq_len}")

    def _validate_csa2(self) -> None:
        c = self.csa2
        if (c.layers is None) == (c.full_every is None):
            raise PlanError("csa2 needs exactly one of layers (a mode per layer) or full_every (an integer >= 1)")
        if self.mla is None and (c.layers is None or "full" in c.layers):
            raise PlanError("csa2 needs an mla section: full layers store MLA latent entries (kv_lora_rank, qk_rope_head_dim)")
        if self.calibration.seq_len <= c.window:
            raise PlanError(
                f"calibration.seq_len={self.calibration.seq_len} must exceed csa2.window={c.window}: readers, entry "
                f"biases and indexers are fitted on positions older than the window; allowed: seq_len > {c.window}"
            )

    def validate_for(self, config) -> None:
        """Checks against the source model's config (run before its weights are loaded)."""
        num_q = config.num_attention_heads
        if self.gqa is not None and num_q % self.gqa.num_key_value_heads:
            divisors = [d for d in range(1, num_q + 1) if num_q % d == 0]
            raise PlanError(
                f"gqa.num_key_value_heads={self.gqa.num_key_value_heads} does not divide the model's "
                f"{num_q} query heads; allowed: {divisors}"
            )
        keep = self.gqa.keep_layers if self.gqa is not None else None
        if keep and max(keep) >= config.num_hidden_layers:
            raise PlanError(f"gqa.keep_layers names layer {max(keep)}; the model has {config.num_hidden_layers} layers; "
                            f"allowed: 0..{config.num_hidden_layers - 1}")
        if self.mla is not None:
            self._validate_mla_for(config)
        if self.csa2 is not None:
            modes = self.csa2.layer_modes(config.num_hidden_layers)
            if len(modes) != config.num_hidden_layers:
                raise PlanError(f"csa2.layers has {len(modes)} modes; the model has {config.num_hidden_layers} layers (one each)")
            try:
                default_sources(modes)
            except ValueError as err:
                raise PlanError(f"csa2.layers: {err}") from err
            head_dim = attention_head_dim(config)
            width = self.csa2.index_head_dim
            if width is not None and (width % 2 or width > head_dim):
                raise PlanError(f"csa2.index_head_dim={width}; allowed: an even number 2..{head_dim} (the attention head "
                                "width: RoPE pairs of it), or null")
            if "lowrank" in modes:
                kv = self.gqa.num_key_value_heads if self.gqa is not None else (
                    getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
                for name in ("lowrank_key_rank", "lowrank_value_rank"):
                    rank = getattr(self.csa2, name)
                    if rank is not None and rank > kv * head_dim:
                        raise PlanError(f"csa2.{name}={rank} exceeds a layer's key/value width {kv * head_dim} "
                                        f"({kv} KV heads x {head_dim}); allowed: 1..{kv * head_dim}")

    def _validate_mla_for(self, config) -> None:
        kv = self.gqa.num_key_value_heads if self.gqa is not None else (
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        qk_norm = config.model_type if config.model_type in QK_NORM_BASE_MODEL_TYPES else None
        self.mla.check_geometry(kv, attention_head_dim(config), qk_norm)

    @property
    def is_noop_surgery(self) -> bool:
        """No surgery section (gqa, mla, sinks, csa2): the plan would change nothing."""
        return all(getattr(self, name) is None for name in SURGERY_SECTIONS)

    @property
    def is_noop(self) -> bool:
        return self.is_noop_surgery and self.distill is None


_ADAPTER = TypeAdapter(ConversionPlan)



# -- fields as data: for generated CLI flags and docs/plans.md ------------------------------

@dataclasses.dataclass(frozen=True)
class PlanField:
    """One field of a plan section, described from its annotation (what the CLI builds its
    flags from and the reference docs are written from)."""

    section: str  # "" for the plan's top-level fields
    name: str
    base: Any  # int, float, bool, str, list, a dataclass, or None for a choice of literals
    choices: tuple | None
    default: Any  # None when required (see ``required``) or when None is the default
    required: bool
    description: str
    allowed: str  # in words, as the error messages say it

    @property
    def path(self) -> str:
        return f"{self.section}.{self.name}" if self.section else self.name

    def validate(self, value: Any) -> Any:
        """``value`` checked against the field's type and bounds alone (checks across fields
        run when the plan is built); raises PlanError naming the field."""
        info = _field_info(tuple(self.path.split(".")))
        try:
            typed = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
            return TypeAdapter(typed).validate_python(value)
        except ValidationError:
            raise PlanError(f"{self.path}={value!r}; allowed: {self.allowed}{_yaml_hint(value)}") from None


def plan_fields(section: str = "") -> list[PlanField]:
    """The fields of the plan section ``section`` (``"gqa"``, ``"distill"``...; ``""``: the
    plan's own top-level fields), in declaration order."""
    cls = ConversionPlan if not section else _unwrap(ConversionPlan.__pydantic_fields__[section].annotation)
    out = []
    for name, info in cls.__pydantic_fields__.items():
        loc = (section, name) if section else (name,)
        base = _unwrap(info.annotation)
        choices = None
        if typing.get_origin(base) is Literal:
            base, choices = None, typing.get_args(base)
        elif typing.get_origin(base) is list:
            base = list
        default = None if info.is_required() else info.get_default(call_default_factory=True)
        if dataclasses.is_dataclass(default):
            default = dataclasses.asdict(default)
        out.append(PlanField(section, name, base, choices, default, info.is_required(), info.description or "",
                             _allowed(loc)))
    return out


def set_fields(data: dict[str, Any], assignments: list[str]) -> dict[str, Any]:
    """Plan mapping ``data`` with ``SECTION.FIELD=VALUE`` assignments applied (VALUE is read as
    YAML: ``3``, ``1.0e-4``, ``true``, ``[full, reuse]``); the plan built from it validates them."""
    return set_typed_fields(data, assignments, PlanError,
                            "SECTION.FIELD=VALUE or FIELD=VALUE, e.g. gqa.ridge=0.5 or context=4096")


# -- error messages ------------------------------------------------------------------------

def _field_info(loc: tuple):
    return field_info(ConversionPlan, loc)


def _allowed(loc: tuple) -> str:
    return allowed(ConversionPlan, loc)


__all__ = ["CalibrationPlan", "ConversionPlan", "Csa2Plan", "DistillPlan", "GqaPlan", "MlaPlan", "PlanError", "PlanField",
           "SinksPlan", "plan_fields", "set_fields",
           "GQA_INITS", "MLA_INITS", "MLA_REMOVED_FIELDS", "SINK_INITS", "SURGERY_SECTIONS", "default_sources",
           "CSA2_PLAN_MODES"]
