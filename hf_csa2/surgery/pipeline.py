"""The staged conversion pipeline.

``convert(source, plan)`` validates everything it can before loading weights, then runs the
plan's stages in order. Each stage is a function ``(model, plan, calib) -> (model, notes)``;
after each one the pipeline scores the model on held calibration windows and measures the
KV-cache elements per token from a live cache, giving the stage report.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from transformers import PreTrainedModel

from ..data.corpus import resolve_text
from ..data.windows import token_windows
from ..io.checkpoint import save_checkpoint
from ..io.output import OUTPUT_MARKER, OutputError, OutputExistsError, check_output_dir
from ..io.sources import SourceError, load_source, peek_config, resolve_source
from ..metrics.kv_cache import (
    config_kv_elements_at_context,
    measure_kv_elements_per_token_at,
)
from ..metrics.answer_check import answer_check, make_probes
from ..metrics.perplexity import mean_nll
from ..model import SUPPORTED_BASE_MODEL_TYPES
from .csa2 import apply_csa2
from .distill import distill_to_source
from .gqa import apply_gqa
from .mla import apply_mla
from .plan import ConversionPlan, MlaPlan, PlanError
from .rebuild import is_csa2, to_native
from .sinks import apply_sinks

logger = logging.getLogger(__name__)  # long stages report progress here (the CLI shows INFO on stderr)


@dataclass
class StageReport:
    """One stage's figures: calibration ppl on the scoring windows and the KV-cache elements
    per token at a ``kv_context``-token context, measured from the live cache (and counted
    from the config, which must agree). Reports written before ``kv_context`` existed hold
    ``None`` there: their figures were measured after a 16-token prefill."""

    stage: str
    calib_ppl: float
    kv_elements_per_token: float
    kv_elements_per_token_config: float
    seconds: float
    notes: dict = field(default_factory=dict)
    kv_context: int | None = None
    answer_check: dict | None = None  # AnswerCheck.to_dict(); None: not run (older reports, or switched off)


@dataclass
class Calibration:
    """Calibration token windows: ``fit`` [N, T] for statistics, ``score`` [M, T] for reports,
    ``distill`` [K, T] for the distillation stage (None without one); ``score`` never overlaps
    the others, ``distill`` starts with the ``fit`` windows."""

    fit: torch.Tensor
    score: torch.Tensor
    distill: torch.Tensor | None = None
    probes: list = field(default_factory=list)  # answer-check probes cut from ``score`` (metrics.answer_check)


@dataclass
class ConversionResult:
    model: PreTrainedModel
    tokenizer: object
    plan: ConversionPlan
    source: str
    report: list[StageReport]

    def report_dict(self) -> dict:
        return {"source": self.source, "plan": self.plan.to_dict(), "stages": [asdict(r) for r in self.report]}

    def save(self, out_dir: str | os.PathLike, overwrite: bool = False, inputs=()) -> Path:
        """Write an HF checkpoint (+ tokenizer, conversion_report.json, the plan) atomically;
        ``inputs``: ``(role, path)`` pairs the output must not touch (see :func:`check_output_dir`)."""
        return save_checkpoint(self.model, self.tokenizer, out_dir, overwrite=overwrite, inputs=inputs,
                               extra_files={OUTPUT_MARKER: json.dumps(self.report_dict(), indent=2),
                                            "hf_csa2_plan.yaml": self.plan.to_yaml()})


# -- stages -----------------------------------------------------------------------------

def gqa_stage(model, plan: ConversionPlan, calib: Calibration, source_model) -> tuple[PreTrainedModel, dict]:
    """Merge KV heads of every layer to ``plan.gqa.num_key_value_heads`` (see :mod:`.gqa`)."""
    new, report = apply_gqa(model, plan.gqa, windows=calib.fit)
    return new, report.stage_notes()


def mla_stage(model, plan: ConversionPlan, calib: Calibration, source_model) -> tuple[PreTrainedModel, dict]:
    """Rewrite every layer into multi-head latent attention (see :mod:`.mla`)."""
    mla = plan.mla
    new, report = apply_mla(model, mla, windows=calib.fit)
    notes = report.stage_notes()
    if mla.compare_weight_svd and mla.init != "weight_svd" and calib.score.shape[0]:
        # Same rope slots, plain SVD latent (no latent norm), no refit: the baseline the init must beat.
        svd = MlaPlan(kv_lora_rank=mla.kv_lora_rank, qk_rope_head_dim=mla.qk_rope_head_dim, rope_key=mla.rope_key,
                      init="weight_svd")
        baseline, _ = apply_mla(model, svd, splits=report.rope_splits)
        notes["weight_svd_calib_ppl"] = mean_nll(baseline, calib.score)["ppl"]
        del baseline
    return new, notes


def sinks_stage(model, plan: ConversionPlan, calib: Calibration, source_model) -> tuple[PreTrainedModel, dict]:
    """Add one sink logit per query head, initialised so the outputs do not change (see :mod:`.sinks`)."""
    new, report = apply_sinks(model, plan.sinks, windows=calib.fit)
    return new, report.stage_notes()


def csa2_stage(model, plan: ConversionPlan, calib: Calibration, source_model) -> tuple[PreTrainedModel, dict]:
    """Rewrite into CSA2 layers (see :mod:`.csa2`): MLA entries in the full layers, readers and
    indexers fitted on the calibration text."""
    new, report = apply_csa2(model, plan.csa2, plan.mla, windows=calib.fit)
    return new, report.stage_notes()


def distill_stage(model, plan: ConversionPlan, calib: Calibration, source_model) -> tuple[PreTrainedModel, dict]:
    """Train the converted model toward the source's next-token distributions (see
    :mod:`hf_csa2.surgery.distill`); in place, the source is only read."""
    d = plan.distill
    notes = distill_to_source(model, source_model, calib.distill, steps=d.steps, lr=d.lr, batch=d.batch,
                              holdout=d.holdout, every=d.every, trainable=d.trainable, log=logger.info)
    return model, {"trainable": d.trainable, "windows": int(calib.distill.shape[0]), **notes}


STAGES: list[tuple[str, Callable]] = [("gqa", gqa_stage), ("mla", mla_stage), ("sinks", sinks_stage), ("csa2", csa2_stage),
                                      ("distill", distill_stage)]


# -- driver -----------------------------------------------------------------------------

def run_stages(model, plan: ConversionPlan, calib: Calibration, *, before: str | None = None,
               on_stage: Callable[[str, PreTrainedModel, float, dict], None] | None = None) -> PreTrainedModel:
    """Run the plan's stages in order on ``model`` (the source), stopping before the stage named
    ``before`` when given; ``on_stage(name, model, start_time, notes)`` after each."""
    source_model = model
    for name, stage in STAGES:
        if name == before:
            break
        if getattr(plan, name) is None or (name == "mla" and plan.csa2 is not None):
            continue  # with csa2, MLA is built inside the csa2 stage (full layers only)
        t = time.perf_counter()
        model, notes = stage(model, plan, calib, source_model)
        if on_stage is not None:
            on_stage(name, model, t, notes)
    return model


def as_plan(plan) -> ConversionPlan:
    """A validated plan from a ConversionPlan, a dict or a YAML path; a plan without any
    surgery section is refused (it would write an unchanged copy)."""
    if isinstance(plan, ConversionPlan):
        pass
    elif isinstance(plan, dict):
        plan = ConversionPlan.from_dict(plan)
    elif isinstance(plan, (str, os.PathLike)):
        plan = ConversionPlan.from_yaml(plan)
    elif plan is None:
        plan = ConversionPlan()
    else:
        raise PlanError(f"plan must be a ConversionPlan, a dict or a YAML path, got {type(plan).__name__}")
    if plan.is_noop_surgery:
        raise PlanError("the plan has no surgery section, so the output would be an unchanged copy; allowed: at least "
                        "one of gqa, mla, sinks, csa2 (see conversion/)")
    return plan


def _stage_report(name: str, model, calib: Calibration, started: float, notes: dict, context: int) -> StageReport:
    ppl = mean_nll(model, calib.score)["ppl"] if calib.score.shape[0] else float("nan")
    return StageReport(
        stage=name, calib_ppl=ppl, kv_elements_per_token=measure_kv_elements_per_token_at(model, context),
        kv_elements_per_token_config=config_kv_elements_at_context(model.config, context) / context,
        seconds=round(time.perf_counter() - started, 2), notes=notes, kv_context=context,
        answer_check=answer_check(model, calib.probes).to_dict() if calib.probes else None,
    )


def conversion_inputs(source_path: Path, plan: ConversionPlan, plan_path=None) -> list[tuple[str, Path]]:
    """What a conversion reads (and its output must therefore never touch)."""
    inputs = [("source", source_path), ("calibration text", resolve_text(plan.calibration.text))]
    if plan_path is not None:
        inputs.append(("plan", Path(plan_path)))
    return inputs


@dataclass
class PreparedSource:
    loaded: object  # LoadedSource: .model, .tokenizer
    model: PreTrainedModel
    calib: Calibration
    kind: str
    config: object


def prepare_source(source: str, plan: ConversionPlan, log: Callable[[str], None] = print, *,
                   trust_remote_code: bool = False, revision: str | None = None,
                   offline: bool | None = None, resolved: tuple[str, Path] | None = None) -> PreparedSource:
    """Check ``plan`` against the source's config (before loading weights), load the source
    and cut the calibration windows (``fit`` / ``score``). ``revision``/``offline``: for Hub IDs;
    ``resolved``: the caller's ``resolve_source`` result, so the source is resolved once."""
    kind, path = resolved or resolve_source(source, revision=revision, offline=offline)
    config = peek_config(kind, path, trust_remote_code=trust_remote_code)
    if config.model_type not in SUPPORTED_BASE_MODEL_TYPES:
        raise SourceError(
            f"{source!r} is a {config.model_type!r} model; supported architectures: {', '.join(SUPPORTED_BASE_MODEL_TYPES)}"
        )
    plan.validate_for(config)
    text_path = resolve_text(plan.calibration.text)
    t0 = time.perf_counter()
    loaded = load_source(source, dtype=getattr(torch, plan.dtype), trust_remote_code=trust_remote_code,
                         resolved=(kind, path))
    model = loaded.model.eval()
    model.config._attn_implementation = model.config._attn_implementation or "sdpa"
    cal = plan.calibration
    fit_windows = cal.num_tokens // cal.seq_len
    distill_windows = plan.distill.num_tokens // cal.seq_len if plan.distill is not None else 0
    windows = token_windows(loaded.tokenizer, text_path, cal.seq_len, max(fit_windows, distill_windows) + cal.eval_windows)
    if windows.shape[0] <= cal.eval_windows:
        raise PlanError(f"calibration text {str(text_path)!r} gives only {windows.shape[0]} windows of {cal.seq_len} tokens")
    if distill_windows and windows.shape[0] < cal.eval_windows + distill_windows:
        raise PlanError(f"calibration text {str(text_path)!r} gives {windows.shape[0]} windows of {cal.seq_len} tokens; "
                        f"distill.num_tokens={plan.distill.num_tokens} needs {cal.eval_windows + distill_windows} "
                        "(with the scoring windows)")
    rest = windows[cal.eval_windows :]
    calib = Calibration(fit=rest[:fit_windows], score=windows[: cal.eval_windows],
                        distill=rest[:distill_windows] if distill_windows else None)
    if cal.answer_probes and cal.eval_windows:
        try:
            calib.probes = make_probes(loaded.tokenizer, calib.score, cal.answer_probes)
        except ValueError as err:  # windows too short for a fact and its question: say so, go on
            log(f"answer check skipped: {err}")
    log(f"loaded {source} ({kind}) in {time.perf_counter() - t0:.1f}s; calibration: {calib.fit.shape[0]}x{cal.seq_len} tokens")
    return PreparedSource(loaded=loaded, model=model, calib=calib, kind=kind, config=config)


def convert(
    source: str,
    plan: ConversionPlan | dict | str | None = None,
    *,
    out_dir: str | os.PathLike | None = None,
    overwrite: bool = False,
    log: Callable[[str], None] = print,
    plan_path: str | os.PathLike | None = None,
    trust_remote_code: bool = False,
    revision: str | None = None,
    offline: bool | None = None,
) -> ConversionResult:
    """Convert ``source`` following ``plan``; save to ``out_dir`` when given.

    All input checks (plan fields, source existence and architecture, KV heads dividing the
    query heads, output folder: never an input, its parent or inside one) run before any
    weights are loaded. ``plan_path``: the file the plan came from, when it was passed as an
    object (protected like the other inputs). A Hub ID is downloaded at ``revision`` (configs,
    safetensors, tokenizer) unless ``offline`` (or ``HF_HUB_OFFLINE=1``): then the cache only.
    """
    if isinstance(plan, (str, os.PathLike)) and plan_path is None:
        plan_path = plan
    plan = as_plan(plan)
    kind, source_path = resolve_source(source, revision=revision, offline=offline)
    inputs = conversion_inputs(source_path, plan, plan_path)
    if out_dir is not None:
        check_output_dir(out_dir, overwrite=overwrite, inputs=inputs)
    t0 = time.perf_counter()
    prepared = prepare_source(source, plan, log, trust_remote_code=trust_remote_code, resolved=(kind, source_path))
    loaded, model, calib, kind, config = (prepared.loaded, prepared.model, prepared.calib, prepared.kind,
                                          prepared.config)
    report = [_stage_report("source", model, calib, t0, {"kind": kind, "model_type": config.model_type}, plan.context)]
    log(format_stage(report[-1]))

    def on_stage(name: str, stage_model, started: float, notes: dict) -> None:
        report.append(_stage_report(name, stage_model, calib, started, notes, plan.context))
        log(format_stage(report[-1]))

    model = run_stages(model, plan, calib, on_stage=on_stage)
    if is_csa2(model) and model.config.uses_only_native_features:
        model = to_native(model)  # e.g. a plain Llama with fewer KV heads: no remote code needed
    result = ConversionResult(model=model, tokenizer=loaded.tokenizer, plan=plan, source=source, report=report)
    if out_dir is not None:
        result.save(out_dir, overwrite=overwrite, inputs=inputs)
        log(f"saved {out_dir}")
    return result


def distill_checkpoint(
    source: str,
    converted: str | os.PathLike,
    *,
    out_dir: str | os.PathLike,
    overrides: dict | None = None,
    overwrite: bool = False,
    log: Callable[[str], None] = print,
    trust_remote_code: bool = False,
) -> ConversionResult:
    """Run (more) distillation toward ``source`` on an already converted checkpoint.

    The distill and calibration settings come from the checkpoint's own ``hf_csa2_plan.yaml``
    (so the windows are those its conversion would cut), with ``overrides`` ({field: value} of
    the ``distill`` section) on top; a plan without a distill section gets the defaults. The
    result is saved to ``out_dir`` (the converted folder itself is never written) with the
    stage appended to its ``conversion_report.json``.
    """
    kind, folder = resolve_source(converted)
    if kind != "dir":
        raise SourceError(f"{str(converted)!r} is not a checkpoint folder; allowed: a folder written by `hf-csa2 convert`")
    plan_path = folder / "hf_csa2_plan.yaml"
    if not plan_path.is_file():
        raise PlanError(f"{str(folder)!r} has no hf_csa2_plan.yaml: only checkpoints written by `hf-csa2 convert` "
                        "can be distilled (their plan says which calibration windows to use)")
    data = ConversionPlan.from_yaml(plan_path).to_dict()
    data["distill"] = {**(data.get("distill") or {}), **(overrides or {})}
    plan = ConversionPlan.from_dict(data)  # validates the overrides before anything is loaded
    _, source_path = resolve_source(source)
    inputs = [("converted checkpoint", folder)] + conversion_inputs(source_path, plan)
    check_output_dir(out_dir, overwrite=overwrite, inputs=inputs)
    report_path = folder / OUTPUT_MARKER
    previous = _read_report(report_path) if report_path.is_file() else {"source": source, "stages": []}
    t0 = time.perf_counter()
    prepared = prepare_source(source, plan, log, trust_remote_code=trust_remote_code)
    student = load_source(folder, dtype=getattr(torch, plan.dtype), trust_remote_code=trust_remote_code).model
    model, notes = distill_stage(student, plan, prepared.calib, prepared.model)
    stage = _stage_report("distill", model, prepared.calib, t0, {"continued_from": str(folder), **notes}, plan.context)
    log(format_stage(stage))
    stages = [StageReport(**r) for r in previous["stages"]] + [stage]
    result = ConversionResult(model=model, tokenizer=prepared.loaded.tokenizer, plan=plan, source=source, report=stages)
    result.save(out_dir, overwrite=overwrite, inputs=inputs)
    log(f"saved {out_dir}")
    return result


def _read_report(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        stages = [StageReport(**r) for r in data["stages"]]
    except (ValueError, KeyError, TypeError) as err:
        raise OutputError(f"{str(path)!r} is not a conversion report hf-csa2 can extend ({err})") from None
    return {**data, "stages": [asdict(r) for r in stages]}


def _context_words(context: int | None) -> str:
    return f"at {context} tokens" if context else "after a 16-token prefill"


def _answers(r: StageReport) -> str:
    """``far 5/6, near 6/6`` (answered probes per depth) or ``-`` when the check did not run."""
    a = r.answer_check
    return "-" if a is None else f"far {a['far']}/{a['per_depth']}, near {a['near']}/{a['per_depth']}"


def format_stage(r: StageReport) -> str:
    return (f"[stage {r.stage:>6}] calib ppl {r.calib_ppl:8.3f} | answer check {_answers(r)} | KV elements/token "
            f"{_context_words(r.kv_context)} {r.kv_elements_per_token:8.1f} (config {r.kv_elements_per_token_config:.1f}) "
            f"| {r.seconds:6.1f}s | {r.notes}")


def format_report_table(report: list[StageReport]) -> str:
    """Markdown table of the stage report (ppl ratios to the source stage); the KV column says
    at which context it was measured."""
    base = report[0].calib_ppl
    contexts = {r.kv_context for r in report}
    header = _context_words(contexts.pop()) if len(contexts) == 1 else "(context per row)"
    lines = [f"| stage | calib ppl | ratio | answer check | KV elements/token {header} |", "|---|---:|---:|---|---:|"]
    for r in report:
        where = f" ({_context_words(r.kv_context)})" if header == "(context per row)" else ""
        lines.append(f"| {r.stage} | {r.calib_ppl:.3f} | {r.calib_ppl / base:.3f} | {_answers(r)} | "
                     f"{r.kv_elements_per_token:.1f}{where} |")
    return "\n".join(lines)


__all__ = ["ConversionResult", "OutputExistsError", "StageReport", "convert", "conversion_inputs", "distill_checkpoint",
           "format_report_table"]
