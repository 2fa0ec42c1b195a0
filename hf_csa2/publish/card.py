"""The model card (README.md) of a published folder, built with ``huggingface_hub.ModelCard``.

Metadata: ``base_model`` (the source's Hub repository; for an adapter, the converted checkpoint
it adapts), ``base_model_relation``, ``library_name: transformers``, ``pipeline_tag:
text-generation``, tags (``hf-csa2`` and the attention kinds), the source's license, and every
figure of :mod:`.evidence` as a model-index entry. Body: what was converted (per-layer table,
stage report), the uplift run, how to load it, the figures with the commands that produced
them, and the losses they show.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from ..io.sources import looks_like_hub_id
from ..metrics.kv_cache import described_layers, format_layer_table
from ..surgery.pipeline import StageReport, format_report_table
from .evidence import Figure, folder_figures
from .provenance import folder_provenance, read_json

CARD_FILE = "README.md"
ADAPTER_CONFIG = "adapter_config.json"


class CardError(UserError, ValueError):
    """What the card must state is not known (license, base model); the message says which flag gives it."""


@dataclass
class CardFacts:
    """What a card states: ``kind`` ``checkpoint`` or ``adapter``, ``base_model`` and
    ``relation`` for the metadata, ``license``, ``source`` (as the report names it), the
    figures, the reports they came from and ``tags``."""

    kind: str
    base_model: str
    relation: str
    license: str
    source: str | None
    figures: list[Figure]
    report: dict
    training: dict | None
    tags: list[str]


def folder_kind(folder: Path) -> str:
    """``adapter`` (a PEFT adapter folder) or ``checkpoint`` (a model folder)."""
    return "adapter" if (folder / ADAPTER_CONFIG).is_file() and not (folder / "config.json").is_file() else "checkpoint"


def attention_tags(config: dict) -> list[str]:
    """``hf-csa2`` plus the attention kinds of a config.json (``mla``, ``csa2``, ``gqa``, ``mqa``, ``sinks``, ...)."""
    tags = ["hf-csa2"]
    layers = config.get("attention_layers")
    if layers:
        for spec in layers:
            kind = spec.get("kind", "dense")
            if kind == "dense":
                kind = "mqa" if spec.get("num_key_value_heads") == 1 else "gqa"
            tags.append(kind)
            if spec.get("sinks"):
                tags.append("attention-sinks")
    elif config.get("model_type") == "deepseek_v3":
        tags.append("mla")
    elif config.get("num_key_value_heads") == 1:
        tags.append("mqa")
    elif config.get("num_key_value_heads", config.get("num_attention_heads")) != config.get("num_attention_heads"):
        tags.append("gqa")
    return list(dict.fromkeys(tags))


def card_facts(folder: Path, *, license: str | None = None, base_model: str | None = None,
               eval_files: list[Path] = ()) -> CardFacts:
    """Gather what the card of ``folder`` states; :class:`CardError` when its license or base
    model is unknown and not given (``license`` / ``base_model`` override what is found)."""
    folder = Path(folder)
    kind = folder_kind(folder)
    if kind == "adapter":
        adapter = read_json(folder / ADAPTER_CONFIG)
        base_path = adapter.get("base_model_name_or_path")
        origin = folder_provenance(Path(base_path)) if base_path and Path(base_path).is_dir() else folder_provenance(folder)
        found_base = base_path if base_path and not Path(base_path).exists() and looks_like_hub_id(base_path) else None
        relation, tags = "adapter", ["hf-csa2", "peft", "lora"]
        base_config = read_json(Path(base_path) / "config.json") if base_path and Path(base_path).is_dir() else {}
        tags += attention_tags(base_config)[1:]
    else:
        origin = folder_provenance(folder)
        found_base = origin.base_model
        relation = "finetune"  # weights rewritten (and trained): derived from the source, not a quantization or merge
        tags = attention_tags(read_json(folder / "config.json"))
    base = base_model or found_base
    lic = license or origin.license
    missing = []
    if not base:
        what = ("the Hub repository of the converted checkpoint this adapter adapts" if kind == "adapter"
                else f"the source's Hub repository (the report names {origin.source!r})")
        missing.append(f"base model unknown: give --base-model REPO_ID ({what})")
    if not lic:
        missing.append(f"license unknown (nothing recorded for source {origin.source!r}): give --license ID "
                       "(the source's license, e.g. apache-2.0)")
    if missing:
        raise CardError("; ".join(missing))
    figures, report, training = folder_figures(folder, list(eval_files))
    return CardFacts(kind, base, relation, lic, origin.source, figures, report, training, list(dict.fromkeys(tags)))


def _eval_results(facts: CardFacts):
    from huggingface_hub import EvalResult

    return [EvalResult(task_type="text-generation", task_name="Causal language modeling", dataset_type=f.dataset,
                       dataset_name=f.dataset, metric_type=f.metric, metric_name=f.label, metric_value=f.value)
            for f in facts.figures] or None


def _losses(facts: CardFacts) -> list[str]:
    """Plain sentences for the figures that show a loss against the source."""
    by = {f.metric: f for f in facts.figures}
    lines = []
    for f in facts.figures:
        if f.metric.endswith("ppl_ratio") and f.value > 1.0:
            lines.append(f"{f.label[:1].upper()}{f.label[1:]}: {f.value} on {f.dataset}.")
        if f.metric in ("answer_check_far", "answer_check_near"):
            ref = by.get(f.metric + "_source")
            if ref is not None and f.value < ref.value:
                where = "far back in" if f.metric.endswith("far") else "near the end of"
                lines.append(f"Facts planted {where} the prompt (answer check): {f.count} answered, the source "
                             f"{ref.count}.")
    if facts.report.get("plan", {}).get("calibration", {}).get("text", "").startswith("python-docs"):
        lines.append("The stage report's perplexity is measured on held-out windows of the calibration text's own "
                     "domain, which flatters the fit; figures on text of another domain (`--eval`) count more.")
    return lines


def _loading(facts: CardFacts, repo_id: str, config: dict) -> str:
    if facts.kind == "adapter":
        return "\n".join([
            "```python", "from transformers import AutoModelForCausalLM", "from peft import PeftModel", "",
            f'base = AutoModelForCausalLM.from_pretrained("{facts.base_model}", trust_remote_code=True)',
            f'model = PeftModel.from_pretrained(base, "{repo_id}")', "```"])
    remote = config.get("model_type") == "hf_csa2"
    lines = ["```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", ""]
    if remote:
        lines += ["# without hf-csa2: the model code ships with the weights",
                  f'model = AutoModelForCausalLM.from_pretrained("{repo_id}", trust_remote_code=True)',
                  "# with hf-csa2 installed (pip install hf-csa2), its own classes and fast paths:",
                  f'# import hf_csa2; model = AutoModelForCausalLM.from_pretrained("{repo_id}")']
    else:
        lines += [f'model = AutoModelForCausalLM.from_pretrained("{repo_id}")  # a stock architecture: no remote code']
    lines += [f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")', "```"]
    return "\n".join(lines)


def _stage_table(report: dict) -> str | None:
    stages = report.get("stages") or []
    if not stages:
        return None
    fields = StageReport.__dataclass_fields__
    return format_report_table([StageReport(**{k: v for k, v in s.items() if k in fields}) for s in stages])


def build_card(folder: Path, repo_id: str, facts: CardFacts):
    """The ``huggingface_hub.ModelCard`` of ``folder`` published as ``repo_id``."""
    from huggingface_hub import ModelCard, ModelCardData

    folder = Path(folder)
    config = read_json(folder / "config.json")
    data = ModelCardData(base_model=facts.base_model, license=facts.license, library_name="transformers",
                         pipeline_tag="text-generation", tags=facts.tags, model_name=repo_id.split("/")[-1],
                         eval_results=_eval_results(facts), base_model_relation=facts.relation)
    what = ("A PEFT adapter for" if facts.kind == "adapter" else "An attention-rewritten version of")
    body = [f"# {repo_id.split('/')[-1]}", "",
            f"{what} [`{facts.base_model}`](https://huggingface.co/{facts.base_model}), made with hf-csa2 "
            f"(source as recorded: `{facts.source}`).", ""]
    if config:
        from transformers import AutoConfig  # hf_csa2's import registered its config class: no remote code runs

        layers = described_layers(AutoConfig.from_pretrained(folder))
        body += ["## What was converted", "", format_layer_table(layers), ""]
    stage_table = _stage_table(facts.report)
    if stage_table:
        body += ["Stage report (`conversion_report.json`; calibration perplexity on held-out windows of "
                 f"`{(facts.report.get('plan') or {}).get('calibration', {}).get('text', 'the calibration text')}`):",
                 "", stage_table, ""]
    uplift = facts.report.get("uplift") or (facts.training and {k: facts.training.get(k) for k in
                                                                 ("teacher", "steps", "tokens_seen")})
    if uplift:
        body += ["## Uplift", "", f"Distilled toward `{uplift.get('teacher')}` for {uplift.get('steps')} steps "
                 f"({uplift.get('tokens_seen'):,} tokens) with `hf-csa2 train` (recipe in `training_report.json`"
                 " of the run).", ""]
    body += ["## How to load", "", _loading(facts, repo_id, config), ""]
    if facts.figures:
        commands = list(dict.fromkeys(f.command for f in facts.figures if f.command))
        ref = {c: f"[{i}]" for i, c in enumerate(commands, 1)}
        body += ["## Measured", "", "| figure | on | value | from | command |", "|---|---|---:|---|---|"]
        body += [f"| {f.label} | {f.dataset} | {f.value} | `{f.origin}` | {ref.get(f.command, 'not recorded')} |"
                 for f in facts.figures]
        body += ["", "Commands:", ""] + [f"{ref[c]} `{c}`  " for c in commands] + [""]
    losses = _losses(facts)
    if losses:
        body += ["## Limits measured", ""] + [f"- {line}" for line in losses] + [""]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body))


__all__ = ["CARD_FILE", "CardError", "CardFacts", "attention_tags", "build_card", "card_facts", "folder_kind"]
