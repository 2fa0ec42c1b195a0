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
SINK_INITS = ("calibrated", "off")
DTYPES = ("float32", "bfloat16", "float16")


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
class SinksPlan:
    """Add one learnable sink logit per query head."""

    init: str = "calibrated"  # "calibrated": just below every calibration row's logsumexp; "off": -1e4
    margin: float = 24.0  # calibrated sinks sit this far (in nats) below the smallest logsumexp seen


@dataclass
class CalibrationPlan:
    """Text used to fit inits and to score each stage."""

    text: str = "python-docs:calib"  # a file/folder, or a named corpus (python-docs:calib)
    num_tokens: int = 8192
    seq_len: int = 512
    eval_windows: int = 4  # windows of seq_len scored after each stage (report ppl)


@dataclass
class ConversionPlan:
    """A full conversion: optional GQA/MQA, optional sinks, calibration settings."""

    gqa: GqaPlan | None = None
    sinks: SinksPlan | None = None
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
        if data.get("sinks") is not None:
            sinks = data["sinks"]
            if sinks is True:
                sinks = {}
            if sinks is not False:
                kwargs["sinks"] = _build(SinksPlan, sinks, "sinks")
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
        if self.sinks is not None and self.sinks.init not in SINK_INITS:
            raise PlanError(f"sinks.init={self.sinks.init!r}; allowed: {', '.join(SINK_INITS)}")
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

    def validate_for(self, config) -> None:
        """Checks against the source model's config (run before its weights are loaded)."""
        num_q = config.num_attention_heads
        if self.gqa is not None and num_q % self.gqa.num_key_value_heads:
            divisors = [d for d in range(1, num_q + 1) if num_q % d == 0]
            raise PlanError(
                f"gqa.num_key_value_heads={self.gqa.num_key_value_heads} does not divide the model's "
                f"{num_q} query heads; allowed: {divisors}"
            )

    @property
    def is_noop(self) -> bool:
        return self.gqa is None and self.sinks is None


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


__all__ = ["CalibrationPlan", "ConversionPlan", "GqaPlan", "PlanError", "SinksPlan", "GQA_INITS", "SINK_INITS"]
