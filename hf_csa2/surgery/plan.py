"""Declarative conversion plans: typed dataclasses mirrored by YAML presets in conversion/.

A plan says WHAT to build; the pipeline decides how. Every field is validated up front,
with errors naming the field and its allowed values, before any model is loaded.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

GQA_INITS = ("calibrated", "mean")
MLA_INITS = ("activation_aware", "weight_svd")
MLA_ROPE_KEYS = ("shared", "per_head")
MLA_ROPE_CRITERIA = ("perturbation", "norm")
SINK_INITS = ("calibrated", "off")
DTYPES = ("float32", "bfloat16", "float16")
CSA2_MODES = ("swa", "full", "reindex", "reuse")  # the model config's list (kept import-free here)
DISTILL_TRAINABLE = ("attention", "all")  # hf_csa2.training.distill.TRAINABLE (kept import-free here)


class PlanError(ValueError):
    """A plan field has a bad value; the message names the field and the allowed values."""


@dataclass
class GqaPlan:
    """Reduce every layer to ``num_key_value_heads`` KV heads (1 = MQA)."""

    num_key_value_heads: int
    init: str = "calibrated"  # "calibrated": RoPE-aware weighted PCA merge; "mean": Ainslie et al. mean-pooling
    refit_output: bool = True  # with "calibrated": least-squares refit of o_proj to the source's attention output
    ridge: float = 0.3  # refit regularisation toward the merged o_proj, relative to mean diag(A^T A)


@dataclass
class MlaPlan:
    """Rewrite every layer into multi-head latent attention.

    Cache per token and layer: ``kv_lora_rank + qk_rope_head_dim`` (+ one key scale per KV head
    for QK-norm sources); ``qk_rope_head_dim`` is the width of the rope key (shared) or of each
    KV head's rope key (per_head).
    """

    kv_lora_rank: int
    qk_rope_head_dim: int
    rope_key: str = "shared"  # "shared": one rope key mixing the KV heads per frequency; "per_head": one per KV head
    rope_criterion: str = "perturbation"  # which frequencies keep RoPE: attention-weighted logit damage, or MHA2MLA's 2-norm
    init: str = "activation_aware"  # latent factorisation: covariance/readout-weighted, or plain weight SVD
    latent_norm: bool = False  # RMS-normalise the latent (DeepSeek-V3 kv_a_layernorm; needed for export)
    uniform_rope: bool = False  # the same rope frequencies in every layer (one rope table; needed for export)
    averaged_values: bool = False  # judge value rows under the attention-averaged input moment (alternating refinement)
    drop_fast_terms: bool = False  # remove non-RoPE terms whose removal costs less than a position-free copy
    uneven_ranks: bool = False  # kv_lora_rank is the average; per-layer ranks from calibration error (same total)
    compare_weight_svd: bool = True  # also score the plain weight-SVD init in the stage report
    refit_output: bool = True  # least-squares refit of o_proj to the source's attention output
    ridge: float = 0.3
    refine_steps: int = 0  # then Adam steps per layer on its output error (best state on held-out windows kept)
    refine_lr: float = 1e-4


@dataclass
class Csa2Plan:
    """Rewrite the model into CSA2 shared-KV sparse layers (needs the ``mla`` section: it says
    how full layers build their shared latent entries).

    The layer plan is either ``layers`` (one mode per layer: full, reindex, reuse, swa) or
    ``full_every: k`` (full at layers 0, k, 2k, ... and ``other_mode`` elsewhere). Reindex
    layers read the nearest earlier full layer, reuse layers the nearest earlier full or
    reindex layer. Each read attends Top-K (``top_k``) plus the layer's own ``window``.
    """

    layers: list | None = None
    full_every: int | None = None
    other_mode: str = "reuse"
    window: int = 128
    top_k: int = 256
    sinks: bool | None = None  # None: keep each layer's own (e.g. from the sinks stage)
    sink_tokens: int = 0  # non-full layers also keep the first N tokens exactly (StreamingLLM attention sinks)
    refine_entry_bias: bool = False  # move each head's entry bias to minimise its read-out error (down to off)
    reader_ridge: float = 1e-3  # reader least squares, relative to mean diag(C^T C)
    refit_output: bool = True  # o_proj of reindex/reuse/swa layers refit to the source's attention output
    indexer_warmup_steps: int = 100  # KL warm-up of full/reindex indexers to the dense attention (0 = training-free only)

    def layer_modes(self, num_layers: int) -> list[str]:
        if self.layers is not None:
            return list(self.layers)
        return ["full" if i % self.full_every == 0 else self.other_mode for i in range(num_layers)]


@dataclass
class SinksPlan:
    """Add one learnable sink logit per query head."""

    init: str = "calibrated"  # "calibrated": just below every calibration row's logsumexp; "off": -1e4
    margin: float = 24.0  # calibrated sinks sit this far (in nats) below the smallest logsumexp seen


@dataclass
class DistillPlan:
    """After the surgery stages: Adam on KL(source || converted) of the next-token
    distributions over calibration windows (the source's predictions are the only targets).

    ``num_tokens`` of calibration text (in windows of ``calibration.seq_len``, after the
    report's scoring windows) of which the last ``holdout`` windows are never trained on and
    decide which state is kept (the converted start included).
    """

    steps: int = 200
    lr: float = 1e-4
    batch: int = 4  # windows per step
    num_tokens: int = 32768
    holdout: int = 4  # windows
    every: int = 10  # held-out check every N steps
    trainable: str = "attention"  # "attention": only the rewritten attention modules; "all": all but embeddings/head


@dataclass
class CalibrationPlan:
    """Text used to fit inits and to score each stage."""

    text: str = "python-docs:calib"  # a file/folder, or a named corpus (python-docs:calib)
    num_tokens: int = 8192
    seq_len: int = 512
    eval_windows: int = 4  # windows of seq_len scored after each stage (report ppl)


@dataclass
class ConversionPlan:
    """A full conversion: optional GQA/MQA, optional MLA, optional sinks, optional CSA2, optional
    distillation toward the source, calibration settings (stages run in that order)."""

    gqa: GqaPlan | None = None
    mla: MlaPlan | None = None
    sinks: SinksPlan | None = None
    csa2: Csa2Plan | None = None
    distill: DistillPlan | None = None
    calibration: CalibrationPlan = field(default_factory=CalibrationPlan)
    dtype: str = "float32"

    def __post_init__(self):
        self.validate()

    # -- construction -------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "ConversionPlan":
        data = dict(data or {})
        _reject_unknown(data, cls, "plan")
        kwargs: dict[str, Any] = {}
        if data.get("gqa") is not None:
            kwargs["gqa"] = _build(GqaPlan, data["gqa"], "gqa")
        if data.get("mla") is not None:
            kwargs["mla"] = _build(MlaPlan, data["mla"], "mla")
        if data.get("sinks") is not None:
            sinks = data["sinks"]
            if sinks is True:
                sinks = {}
            if sinks is not False:
                kwargs["sinks"] = _build(SinksPlan, sinks, "sinks")
        if data.get("csa2") is not None:
            kwargs["csa2"] = _build(Csa2Plan, data["csa2"], "csa2")
        if data.get("distill") is not None:
            kwargs["distill"] = _build(DistillPlan, data["distill"], "distill")
        if data.get("calibration") is not None:
            kwargs["calibration"] = _build(CalibrationPlan, data["calibration"], "calibration")
        if "dtype" in data:
            kwargs["dtype"] = data["dtype"]
        return cls(**kwargs)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "ConversionPlan":
        path = Path(path)
        if not path.is_file():
            raise PlanError(f"plan file {str(path)!r} does not exist")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            raise PlanError(f"plan file {str(path)!r} is not valid YAML: {err}") from err
        if data is not None and not isinstance(data, dict):
            raise PlanError(f"plan file {str(path)!r} must hold a mapping, got {type(data).__name__}")
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    # -- validation -----------------------------------------------------------------------
    def validate(self) -> None:
        """Checks that need no model."""
        if self.dtype not in DTYPES:
            raise PlanError(f"dtype={self.dtype!r}; allowed: {', '.join(DTYPES)}")
        if self.gqa is not None:
            kv = self.gqa.num_key_value_heads
            if not isinstance(kv, int) or isinstance(kv, bool) or kv < 1:
                raise PlanError(f"gqa.num_key_value_heads={kv!r}; allowed: a positive integer dividing the query heads")
            if not isinstance(self.gqa.ridge, (int, float)) or self.gqa.ridge <= 0:
                raise PlanError(f"gqa.ridge={self.gqa.ridge!r}; allowed: a positive number")
            if self.gqa.init not in GQA_INITS:
                raise PlanError(f"gqa.init={self.gqa.init!r}; allowed: {', '.join(GQA_INITS)}")
        if self.mla is not None:
            self._validate_mla()
        if self.csa2 is not None:
            self._validate_csa2()
        if self.sinks is not None and self.sinks.init not in SINK_INITS:
            raise PlanError(f"sinks.init={self.sinks.init!r}; allowed: {', '.join(SINK_INITS)}")
        if self.distill is not None:
            self._validate_distill()
        cal = self.calibration
        for name in ("num_tokens", "seq_len", "eval_windows"):
            value = getattr(cal, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "eval_windows" else 1):
                raise PlanError(f"calibration.{name}={value!r}; allowed: a positive integer")
        if cal.num_tokens < cal.seq_len:
            raise PlanError(
                f"calibration.num_tokens={cal.num_tokens} is below calibration.seq_len={cal.seq_len}; "
                "allowed: num_tokens >= seq_len"
            )

    def _validate_mla(self) -> None:
        mla = self.mla
        for name in ("kv_lora_rank", "qk_rope_head_dim"):
            value = getattr(mla, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (1 if name == "kv_lora_rank" else 0):
                raise PlanError(f"mla.{name}={value!r}; allowed: a {'positive' if name == 'kv_lora_rank' else 'non-negative'} integer")
        if mla.qk_rope_head_dim % 2:
            raise PlanError(f"mla.qk_rope_head_dim={mla.qk_rope_head_dim}; allowed: an even number (RoPE rotates pairs)")
        for name, allowed in (("rope_key", MLA_ROPE_KEYS), ("rope_criterion", MLA_ROPE_CRITERIA), ("init", MLA_INITS)):
            if getattr(mla, name) not in allowed:
                raise PlanError(f"mla.{name}={getattr(mla, name)!r}; allowed: {', '.join(allowed)}")
        if not isinstance(mla.ridge, (int, float)) or mla.ridge <= 0:
            raise PlanError(f"mla.ridge={mla.ridge!r}; allowed: a positive number")
        if not isinstance(mla.refine_steps, int) or isinstance(mla.refine_steps, bool) or mla.refine_steps < 0:
            raise PlanError(f"mla.refine_steps={mla.refine_steps!r}; allowed: an integer >= 0")
        if not isinstance(mla.refine_lr, (int, float)) or isinstance(mla.refine_lr, bool) or mla.refine_lr <= 0:
            raise PlanError(f"mla.refine_lr={mla.refine_lr!r}; allowed: a positive number")
        if mla.refine_steps and mla.init == "weight_svd":
            raise PlanError("mla.refine_steps needs init: activation_aware (weight_svd is the calibration-free baseline)")
        fit_windows = self.calibration.num_tokens // self.calibration.seq_len
        if mla.refine_steps and fit_windows < 3:
            raise PlanError(f"mla.refine_steps needs at least 3 calibration windows (2 are held out to pick the kept "
                            f"state); calibration.num_tokens={self.calibration.num_tokens} / seq_len="
                            f"{self.calibration.seq_len} gives {fit_windows}")

    def _validate_distill(self) -> None:
        d = self.distill
        for name, low in (("steps", 1), ("batch", 1), ("num_tokens", 1), ("holdout", 1), ("every", 1)):
            value = getattr(d, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise PlanError(f"distill.{name}={value!r}; allowed: an integer >= {low}")
        if not isinstance(d.lr, (int, float)) or isinstance(d.lr, bool) or d.lr <= 0:
            raise PlanError(f"distill.lr={d.lr!r}; allowed: a positive number")
        if d.trainable not in DISTILL_TRAINABLE:
            raise PlanError(f"distill.trainable={d.trainable!r}; allowed: {', '.join(DISTILL_TRAINABLE)}")
        if self.gqa is None and self.mla is None and self.csa2 is None and self.sinks is None:
            raise PlanError("distill needs a surgery stage before it (gqa, mla, sinks or csa2): there is nothing to distill")
        windows = d.num_tokens // self.calibration.seq_len
        if windows <= d.holdout:
            raise PlanError(f"distill.num_tokens={d.num_tokens} gives {windows} windows of calibration.seq_len="
                            f"{self.calibration.seq_len}, not more than distill.holdout={d.holdout}; allowed: "
                            f"num_tokens >= {(d.holdout + 1) * self.calibration.seq_len}")

    def _validate_csa2(self) -> None:
        c = self.csa2
        if self.mla is None:
            raise PlanError("csa2 needs an mla section: full layers store MLA latent entries (kv_lora_rank, qk_rope_head_dim)")
        if self.mla.uneven_ranks:
            raise PlanError("csa2 with mla.uneven_ranks=true is not supported; allowed: uneven_ranks: false")
        for name in ("window", "top_k"):
            value = getattr(c, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"csa2.{name}={value!r}; allowed: an integer >= 1")
        if (c.layers is None) == (c.full_every is None):
            raise PlanError("csa2 needs exactly one of layers (a mode per layer) or full_every (an integer >= 1)")
        if c.layers is not None:
            bad = [m for m in c.layers if m not in CSA2_MODES]
            if not isinstance(c.layers, list) or bad:
                raise PlanError(f"csa2.layers has {bad or c.layers!r}; allowed modes: {', '.join(CSA2_MODES)}")
        else:
            if not isinstance(c.full_every, int) or isinstance(c.full_every, bool) or c.full_every < 1:
                raise PlanError(f"csa2.full_every={c.full_every!r}; allowed: an integer >= 1")
            if c.other_mode not in ("reuse", "reindex", "swa"):
                raise PlanError(f"csa2.other_mode={c.other_mode!r}; allowed: reuse, reindex, swa")
        if self.calibration.seq_len <= c.window:
            raise PlanError(
                f"calibration.seq_len={self.calibration.seq_len} must exceed csa2.window={c.window}: readers, entry "
                f"biases and indexers are fitted on positions older than the window; allowed: seq_len > {c.window}"
            )
        if not isinstance(c.sink_tokens, int) or isinstance(c.sink_tokens, bool) or c.sink_tokens < 0:
            raise PlanError(f"csa2.sink_tokens={c.sink_tokens!r}; allowed: an integer >= 0")
        steps = c.indexer_warmup_steps
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
            raise PlanError(f"csa2.indexer_warmup_steps={steps!r}; allowed: an integer >= 0")
        if not isinstance(c.reader_ridge, (int, float)) or c.reader_ridge <= 0:
            raise PlanError(f"csa2.reader_ridge={c.reader_ridge!r}; allowed: a positive number")

    def validate_for(self, config) -> None:
        """Checks against the source model's config (run before its weights are loaded)."""
        num_q = config.num_attention_heads
        if self.gqa is not None and num_q % self.gqa.num_key_value_heads:
            divisors = [d for d in range(1, num_q + 1) if num_q % d == 0]
            raise PlanError(
                f"gqa.num_key_value_heads={self.gqa.num_key_value_heads} does not divide the model's "
                f"{num_q} query heads; allowed: {divisors}"
            )
        if self.mla is not None:
            self._validate_mla_for(config)
        if self.csa2 is not None:
            modes = self.csa2.layer_modes(config.num_hidden_layers)
            if len(modes) != config.num_hidden_layers:
                raise PlanError(f"csa2.layers has {len(modes)} modes; the model has {config.num_hidden_layers} layers (one each)")
            from .csa2 import default_sources

            try:
                default_sources(modes)
            except ValueError as err:
                raise PlanError(f"csa2.layers: {err}") from err

    def _validate_mla_for(self, config) -> None:
        from ..model.configuration_hf_csa2 import QK_NORM_BASE_MODEL_TYPES, attention_head_dim

        mla = self.mla
        d = attention_head_dim(config)
        kv = self.gqa.num_key_value_heads if self.gqa is not None else (
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        mixed = mla.rope_key == "shared" and kv > 1
        if mixed and config.model_type in QK_NORM_BASE_MODEL_TYPES:
            raise PlanError(
                f"mla.rope_key='shared' with {kv} KV heads needs a source without QK-norm ({config.model_type} "
                "normalises each key head separately); allowed here: rope_key: per_head, or gqa.num_key_value_heads: 1"
            )
        max_rope = kv * d if mixed else d
        if mla.qk_rope_head_dim > max_rope:
            raise PlanError(f"mla.qk_rope_head_dim={mla.qk_rope_head_dim}; allowed: 0..{max_rope} (even) for this model")
        nope = d if mixed else d - mla.qk_rope_head_dim
        exact = kv * (nope + d)
        if mla.kv_lora_rank > exact:
            raise PlanError(
                f"mla.kv_lora_rank={mla.kv_lora_rank} exceeds {exact}, the width of the stacked position-free "
                f"keys and values ({kv} KV heads); allowed: 1..{exact}"
            )

    @property
    def is_noop(self) -> bool:
        return self.gqa is None and self.mla is None and self.sinks is None and self.csa2 is None and self.distill is None


def _reject_unknown(data: dict, cls, where: str) -> None:
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise PlanError(f"unknown key(s) {unknown} in {where}; allowed: {', '.join(allowed)}")


def _build(cls, data: Any, where: str):
    if not isinstance(data, dict):
        raise PlanError(f"{where} must be a mapping, got {data!r}")
    _reject_unknown(data, cls, where)
    try:
        return cls(**data)
    except TypeError as err:  # a required field is missing
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
        raise PlanError(f"{where} needs the field(s) {required}: {err}") from err


__all__ = ["CalibrationPlan", "ConversionPlan", "Csa2Plan", "DistillPlan", "GqaPlan", "MlaPlan", "PlanError", "SinksPlan", "GQA_INITS", "MLA_INITS",
           "SINK_INITS"]
