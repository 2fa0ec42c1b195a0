"""Uplift recipes: typed dataclasses mirrored by the YAML files in recipes/ (torchtune/litgpt style).

A recipe says what to train (``student``), toward what (``teacher``), on which text (``data``),
with which loss, adapter, optimiser and schedule, for how long, and how often to evaluate and
save. Every field is typed and bounded; a bad recipe (unknown key, wrong type, impossible value)
fails with one line naming the field and what it allows, before any model is loaded.

Example (recipes/smollm2-mqa.yaml)::

    student: runs/smollm2-mqa          # a converted folder; or a source with `plan:` to convert first
    data: {text: python-docs:calib, seq_len: 512}
    loss: {kind: kd, temperature: 1.0}
    peft: {r: 16, alpha: 32}
    optim: {lr: 2.0e-4}
    steps: 400
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

import yaml
from pydantic import BeforeValidator, Field, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass

from ..engine.trainer import LOSSES, TRAINABLE
from ..errors import UserError
from ..surgery.plan import ConversionPlan, PlanError
from ..surgery.plan import set_fields as set_plan_fields
from ..typed_config import CONFIG, Bool, Text, check_keys, describe, doc, int_in, number_in, read_yaml_file
from ..typed_config import set_fields as set_typed_fields

DATA_FORMATS = ("auto", "text", "chat")
ANSWER_SOURCES = ("passage", "teacher")
CHAT_TASKS = ("continue", "recall", "next", "fill", "first", "lookalike", "planted")
SCHEDULES = ("cosine", "linear", "constant")
MAX_STEPS = 10_000_000
MAX_SEQ = 1 << 20
MAX_TOKENS = 1 << 40


class RecipeError(UserError, ValueError):
    """A recipe field has a bad value; the message names the field and the allowed values."""


def _one_or_more(value):
    """``text: a`` is ``text: [a]``."""
    return [value] if isinstance(value, str) else value


@dataclass(config=CONFIG)
class DataSpec:
    """Training text, through the ``datasets`` library: tokenised, packed into ``seq_len`` blocks
    (documents joined by the EOS token) and cached on disk."""

    text: Annotated[list[Text], BeforeValidator(_one_or_more), Field(min_length=1), doc(
        "a named corpus (python-docs:calib), a text file or folder, a .jsonl file of chat records "
        "({\"messages\": [...]}) or texts ({\"text\": ...}), or a folder written by datasets' save_to_disk; "
        "or a list of them, mixed: their packed blocks taken in turn, one of each, until every one is used "
        "up (so with num_tokens they come in equal parts)")] = dataclasses.field(
            default_factory=lambda: ["python-docs:calib"])
    seq_len: Annotated[int_in(8, MAX_SEQ), doc("tokens per training block")] = 512
    num_tokens: Annotated[Optional[int_in(8, MAX_TOKENS)], doc("use at most this many tokens of it (null: all)")] = None
    format: Annotated[Literal[DATA_FORMATS], doc(
        "text: plain text packed as it is (passages with a completion lead-in when data.tasks has copy tasks); chat: plain text turned into chat exchanges (a user turn asking to "
        "continue a passage, the passage's own continuation as the answer) rendered with the student's chat "
        "template; auto: chat when the student's tokenizer has a chat template, else text. Chat records "
        "({\"messages\": [...]}) always use the template")] = "auto"
    passage_chars: Annotated[int_in(64, 1 << 20), doc(
        "characters of text per passage: per chat exchange (continue splits it between the user turn and the "
        "answer), and per document of the text format when data.tasks has a copy task")] = 1600
    tasks: Annotated[list[Literal[CHAT_TASKS]], Field(min_length=1), doc(
        "what passages of plain text become, in turn: continue (chat: the first half asked to be continued; "
        "text: the passage as it is), recall (the whole passage, then: quote the sentence that begins with "
        "these words), next (the whole passage, then: quote the sentence after this one), fill (the whole passage, "
        "then one of its sentences with a word left out: which word), first (the whole passage, then two of its "
        "words: which comes first), lookalike (the passage with a near-copy of one sentence planted far from it, "
        "then the original with a word left out: which word, not the copy's), planted (the passage with a sentence "
        "of another document of the same data.text entry planted at a random place, then that sentence with a word "
        "left out that the passage never has: which word; an entry of one document has none to plant). In the text format the copy tasks "
        "are a lead-in quoting the cue and the answer, for base models. The copy tasks train "
        "copying from the prompt, which perplexity-only distillation does not bring back")] = dataclasses.field(
            default_factory=lambda: ["continue"])
    answers: Annotated[Literal[ANSWER_SOURCES], doc(
        "who writes the assistant turns of chat exchanges: passage (the passage's continuation, the sentence a "
        "copy task asks for; a chat record's own answer) or teacher (the teacher's greedy answer to the same user "
        "turn, generated once and cached on disk; only as many exchanges as the run reads). Chat format only")] = "passage"
    answer_tokens: Annotated[int_in(1, 1 << 14), doc(
        "answers: teacher: tokens generated per answer at most; an answer not ended by then is cut after its last "
        "full sentence (dropped if it has none)")] = 128


@dataclass(config=CONFIG)
class LossSpec:
    """``kd``: forward KL(teacher || student) of the next-token distributions at ``temperature``
    (scaled by temperature^2); ``lm``: next-token cross-entropy on the text; ``kd+lm``:
    ``(1 - lm_weight) * kd + lm_weight * lm``.

    CSA2 students (full / reindex layers have indexers, which no distillation loss reaches): the
    indexer loss is KL(teacher's head-summed dense attention || indexer distribution) over the
    positions an indexer may pick (DeepSeek-V3.2 DSA). The first ``indexer_steps`` steps train the
    indexers alone on it at a constant ``optim.indexer_lr`` (stage 1); then the schedule starts
    (warm-up included) and the loss above is trained with the indexer loss added at
    ``indexer_weight`` (stage 2; 0 keeps the indexers as stage 1 left them)."""

    kind: Annotated[Literal[LOSSES], doc("kd, kd+lm or lm")] = "kd"
    temperature: Annotated[number_in(100.0), doc("softmax temperature of both distributions in kd")] = 1.0
    lm_weight: Annotated[number_in(1.0, positive=False), doc("weight of the lm term in kd+lm")] = 0.5
    positions: Annotated[Optional[int_in(1, MAX_SEQ)], doc(
        "score the loss on this many positions per block, drawn at random for every micro-batch, teacher and "
        "student computing logits there only (null: every position). An unbiased estimate of the full loss "
        "that saves most of the output head's and the KL's cost: with a 262K vocabulary (Gemma-3) they are "
        "a large share of a step; must be less than data.seq_len - 1")] = None
    answer_weight: Annotated[number_in(1000.0), doc(
        "weight of the loss on answer tokens (an exchange's assistant turn, end-of-turn included; a copy "
        "task's sentence) relative to the other tokens of a block, in a weighted mean: >1 puts the "
        "training on answering from the prompt (as completion-only SFT does, with the context kept in "
        "the loss at weight 1); 1: every token alike")] = 1.0
    on_policy: Annotated[number_in(1.0, positive=False), doc(
        "share of micro-batches on which the student writes each block's last answer itself (greedy, from "
        "the block cut before it) and is trained on the teacher's distribution over those tokens alone "
        "(on-policy distillation, GKD); 0: off. Needs kind kd and data with answers (chat exchanges or "
        "copy tasks)")] = 0.0
    on_policy_tokens: Annotated[int_in(1, 4096), doc(
        "on_policy: tokens the student writes per answer at most (stopped at its end-of-turn)")] = 32
    indexer_steps: Annotated[int_in(0, MAX_STEPS), doc(
        "CSA2: first optimizer steps that train only the indexers, on the indexer loss (counted in steps)")] = 0
    indexer_weight: Annotated[number_in(100.0, positive=False), doc(
        "CSA2: the indexer loss beside the loss above after the indexer steps (0: indexers frozen then); "
        "their step size is optim.indexer_lr, the weight sets the loss's share of the clipped gradient norm")] = 0.0

    @property
    def uses_indexer(self) -> bool:
        return self.indexer_steps > 0 or self.indexer_weight > 0


@dataclass(config=CONFIG)
class PeftSpec:
    """LoRA (``peft.LoraConfig``) on the attention projections the student shares with its
    teacher; the parameters the surgery created or reshaped (sinks, latent and up projections,
    readers, entry biases, indexers, a reshaped k_proj) are trained in full beside it."""

    r: Annotated[int_in(1, 4096), doc("LoRA rank")] = 16
    alpha: Annotated[int_in(1, 1 << 16), doc("LoRA alpha (scale alpha / r)")] = 32
    dropout: Annotated[number_in(0.99, positive=False), doc("LoRA dropout")] = 0.0
    target_modules: Annotated[Optional[list[Text]], Field(min_length=1), doc(
        "module name suffixes LoRA wraps (null: every linear layer inside self_attn that the teacher also has)")] = None
    layers: Annotated[Optional[list[int_in(0, 1 << 16)]], Field(min_length=1), doc(
        "decoder layer indices LoRA wraps (like peft's layers_to_transform; null: every layer)")] = None
    train_surgery_parameters: Annotated[Bool, doc("train the surgery-created parameters in full beside LoRA")] = True


@dataclass(config=CONFIG)
class OptimSpec:
    lr: Annotated[number_in(1.0), doc("AdamW learning rate")] = 1e-4
    weight_decay: Annotated[number_in(1.0, positive=False), doc("AdamW weight decay")] = 0.0
    max_grad_norm: Annotated[number_in(1e6), doc("gradient clipping norm")] = 1.0
    indexer_lr: Annotated[Optional[number_in(1.0)], doc(
        "CSA2: AdamW learning rate of the indexers (null: lr); they get no gradient but the indexer loss's")] = None


@dataclass(config=CONFIG)
class ScheduleSpec:
    kind: Annotated[Literal[SCHEDULES], doc("learning-rate schedule after warm-up")] = "cosine"
    warmup_steps: Annotated[int_in(0, MAX_STEPS), doc("linear warm-up steps")] = 0


@dataclass(config=CONFIG)
class EvalSpec:
    """Held-out perplexity ratio to the teacher on fixed windows, every ``every`` steps (and at
    the start and end); with ``answers`` also the answer check (:mod:`hf_csa2.metrics.answer_check`)."""

    every: Annotated[int_in(1, MAX_STEPS), doc("evaluate every N optimizer steps")] = 50
    texts: Annotated[list[Text], Field(min_length=1), doc("held-out corpora or files scored")] = dataclasses.field(
        default_factory=lambda: ["python-docs:heldout", "fortunes:heldout"])
    seq_len: Annotated[int_in(2, MAX_SEQ), doc("tokens per held-out window")] = 512
    windows: Annotated[int_in(1, 4096), doc("held-out windows per text")] = 4
    answers: Annotated[int_in(0, 64), doc(
        "answer check at every evaluation: facts planted far / near in seq_len-token windows of each text, "
        "asked back; probes per depth (0: off)")] = 0


@dataclass(config=CONFIG)
class SaveSpec:
    every: Annotated[int_in(1, MAX_STEPS), doc("write a resumable checkpoint every N optimizer steps")] = 50
    keep: Annotated[int_in(1, 1000), doc("checkpoints kept (the oldest are deleted)")] = 2


@dataclass(config=CONFIG)
class Recipe:
    """One uplift run. ``steps`` optimizer steps of ``batch`` blocks per process times
    ``grad_accum`` micro-batches."""

    student: Annotated[Text, doc("a converted folder (hf-csa2 convert --out), or a source when plan is given")]
    plan: Annotated[Optional[Text], doc("a conversion plan: the student is converted from it first (null: "
                                        "student is already converted)")] = None
    plan_set: Annotated[list[Text], doc(
        "overrides of the plan's fields, as `hf-csa2 convert --set`: SECTION.FIELD=VALUE or FIELD=VALUE, "
        "e.g. [distill=null] (the recipe's training replaces the plan's own distillation)")] = \
        dataclasses.field(default_factory=list)
    teacher: Annotated[Optional[Text], doc("the model distilled from (null: the student's recorded source)")] = None
    data: DataSpec = dataclasses.field(default_factory=DataSpec)
    loss: LossSpec = dataclasses.field(default_factory=LossSpec)
    peft: Optional[PeftSpec] = dataclasses.field(default_factory=PeftSpec)
    trainable: Annotated[Literal[TRAINABLE], doc(
        "with peft null, the parameters trained in full: attention (inside self_attn) or all (but embeddings "
        "and head)")] = "attention"
    optim: OptimSpec = dataclasses.field(default_factory=OptimSpec)
    schedule: ScheduleSpec = dataclasses.field(default_factory=ScheduleSpec)
    steps: Annotated[int_in(1, MAX_STEPS), doc("optimizer steps")] = 100
    batch: Annotated[int_in(1, 65536), doc("blocks per micro-batch and process")] = 4
    grad_accum: Annotated[int_in(1, 65536), doc("micro-batches per optimizer step")] = 1
    log_every: Annotated[int_in(1, MAX_STEPS), doc("log the training loss every N optimizer steps")] = 10
    eval: EvalSpec = dataclasses.field(default_factory=EvalSpec)
    save: SaveSpec = dataclasses.field(default_factory=SaveSpec)
    seed: Annotated[int_in(0, 2**32 - 1), doc("seed of initialisation, data order and dropout")] = 0

    @classmethod
    def from_dict(cls, data: Any) -> "Recipe":
        if not isinstance(data, dict):
            raise RecipeError(f"a recipe must be a mapping of fields ({', '.join(f.name for f in dataclasses.fields(cls))}), "
                              f"got {type(data).__name__}")
        check_keys(data, "recipe", RecipeError, "recipe")
        data = dict(data)
        if data.get("peft") is True:
            data["peft"] = {}
        try:
            recipe = _ADAPTER.validate_python(data)
        except ValidationError as err:
            raise RecipeError(describe(err, Recipe, "recipe")) from None
        if recipe.plan_set and recipe.plan is None:
            raise RecipeError(f"recipe.plan_set={recipe.plan_set} needs recipe.plan (the plan it changes); "
                              "set plan, or drop plan_set")
        if recipe.loss.positions is not None and recipe.loss.positions >= recipe.data.seq_len - 1:
            raise RecipeError(f"recipe.loss.positions={recipe.loss.positions} must be less than data.seq_len - 1 = "
                              f"{recipe.data.seq_len - 1} (the positions that predict a token of a block); "
                              "null scores every position")
        if recipe.data.answers == "teacher" and recipe.data.format == "text":
            raise RecipeError("recipe.data.answers=teacher writes the assistant turns of chat exchanges, but "
                              "data.format=text has none; use data.format: chat or auto, or data.answers: passage")
        if recipe.loss.on_policy and recipe.loss.kind != "kd":
            raise RecipeError(f"recipe.loss.on_policy={recipe.loss.on_policy} needs loss.kind: kd (the teacher's "
                              f"distribution over the student's own tokens), not {recipe.loss.kind!r}: an lm term "
                              "would train the student on what it wrote itself")
        if recipe.loss.on_policy and recipe.data.format == "text" and set(recipe.data.tasks) == {"continue"}:
            raise RecipeError(f"recipe.loss.on_policy={recipe.loss.on_policy} needs answers for the student to "
                              "write, but data.format=text with data.tasks=[continue] has none; use data.format: "
                              "chat or auto, or add copy tasks to data.tasks")
        if recipe.loss.indexer_steps >= recipe.steps:
            raise RecipeError(f"recipe.loss.indexer_steps={recipe.loss.indexer_steps} must be less than "
                              f"recipe.steps={recipe.steps} (the indexer steps come first, then the distillation)")
        return recipe

    def conversion_plan(self) -> Optional[ConversionPlan]:
        """The plan the student is converted with (``plan`` with ``plan_set`` applied), validated;
        None when the student is already converted."""
        if self.plan is None:
            return None
        data = ConversionPlan.from_yaml(self.plan).to_dict()
        try:
            return ConversionPlan.from_dict(set_plan_fields(data, list(self.plan_set)))
        except PlanError as err:
            raise RecipeError(f"recipe.plan_set={list(self.plan_set)} on plan {self.plan!r}: {err}") from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


_ADAPTER = TypeAdapter(Recipe)


def read_recipe_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a recipe YAML file (refused: missing, a folder, not UTF-8, not YAML, empty)."""
    data = read_yaml_file(path, RecipeError, "recipe", "recipes/")
    if data is None:
        raise RecipeError(f"recipe file {str(path)!r} is empty; it needs at least the field 'student'")
    return data


def load_recipe(path: str | Path | None, overrides: list[str] = ()) -> Recipe:
    """A recipe from a YAML file (or from ``overrides`` alone when ``path`` is None) with
    ``--set a.b=VALUE`` overrides applied, validated."""
    data = read_recipe_file(path) if path is not None else {}
    if not isinstance(data, dict):
        raise RecipeError(f"recipe file {str(path)!r} must hold a mapping of fields, got {type(data).__name__}")
    data = set_typed_fields(data, list(overrides), RecipeError, "FIELD=VALUE or SECTION.FIELD=VALUE, e.g. "
                            "student=runs/mqa or optim.lr=2.0e-4")
    return Recipe.from_dict(data)


__all__ = ["ANSWER_SOURCES", "CHAT_TASKS", "DataSpec", "EvalSpec", "LOSSES", "LossSpec", "OptimSpec", "PeftSpec", "Recipe", "RecipeError",
           "DATA_FORMATS", "SCHEDULES", "SaveSpec", "ScheduleSpec", "TRAINABLE", "load_recipe", "read_recipe_file"]
