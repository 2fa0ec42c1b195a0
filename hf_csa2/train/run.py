"""``hf-csa2 train``: check a recipe and its inputs, load student and teacher, train with
:class:`.trainer.UpliftTrainer`, write the outputs.

Outputs in ``out`` (written by the main process):

* ``checkpoints/checkpoint-N/`` -- Trainer checkpoints (``--resume`` continues from the newest);
* ``adapter/`` -- the PEFT adapter (``PeftModel.from_pretrained(student, "adapter")``), with
  the surgery parameters trained in full inside its weights file;
* ``merged/`` -- the student with the adapter merged, in the student's own format (a native
  Llama stays a native Llama; an hf_csa2 checkpoint keeps its copied model code);
* ``training_report.json`` -- the recipe, student, teacher, tokens seen, wall time, the loss and
  eval history; ``curves.png`` -- training loss and held-out ratios against steps.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable

import datasets
import yaml
from transformers import default_data_collator
from transformers.trainer_utils import get_last_checkpoint

from ..data.corpus import resolve_text
from ..data.windows import token_windows
from ..io.checkpoint import save_checkpoint
from ..metrics.answer_check import make_probes
from ..io.output import OUTPUT_MARKER, check_output_dir, check_results_dir
from ..io.sources import load_source, resolve_source
from ..surgery.pipeline import convert
from .data import training_blocks
from .indexer_phase import IndexerLoss, dense_teacher, indexed_layers, shortest_block
from .recipe import Recipe, RecipeError
from ..engine.trainer import DistillationTrainer, save_adapter_extras
from .trainer import prepare_student, training_arguments

REPORT = "training_report.json"
RECIPE_COPY = "recipe.yaml"


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _recorded_source(folder: Path) -> str | None:
    marker = folder / OUTPUT_MARKER
    if not marker.is_file():
        return None
    return json.loads(marker.read_text()).get("source")


def _eval_name(text: str) -> str:
    """A metric name for a held-out text: a file's or folder's stem, else the corpus name."""
    path = Path(text).expanduser()
    name = path.stem if path.exists() else text.split(":")[0]
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)


def check_inputs(recipe: Recipe, out: Path, *, resume: bool, overwrite: bool) -> tuple[str, Path | None]:
    """Every check that needs no model: student/teacher exist, a teacher is known, the plan is valid,
    the texts resolve, the output folder may be written (or holds a checkpoint to resume).
    Returns ``(teacher, checkpoint to resume from or None)``."""
    _, student_path = resolve_source(recipe.student)
    recipe.conversion_plan()
    teacher = recipe.teacher
    if teacher is None:
        teacher = recipe.student if recipe.plan is not None else _recorded_source(student_path)
        if teacher is None:
            raise RecipeError(f"student={recipe.student!r} has no {OUTPUT_MARKER} naming its source; set teacher")
    _, teacher_path = resolve_source(teacher)
    for text in list(recipe.data.text) + list(recipe.eval.texts):
        if not Path(text).expanduser().exists():
            resolve_text(text)
    inputs = [("student", student_path), ("teacher", teacher_path)]
    if resume:
        check_results_dir(out, inputs=inputs)
        last = get_last_checkpoint(str(out / "checkpoints")) if (out / "checkpoints").is_dir() else None
        if last is None:
            raise RecipeError(f"--resume: {str(out)!r} holds no checkpoint (checkpoints/checkpoint-N); "
                              "start without --resume")
        saved = out / RECIPE_COPY
        if saved.is_file() and Recipe.from_dict(_yaml(saved)) != recipe:
            raise RecipeError(f"--resume: the recipe differs from the one {str(out)!r} was started with "
                              f"({saved}); resume with the same recipe, or start a new --out")
        return teacher, Path(last)
    if _rank() == 0:
        check_output_dir(out, overwrite=overwrite, inputs=inputs)
    return teacher, None


def _yaml(path: Path):
    return yaml.safe_load(path.read_text())


def _same_tokenizer(a, b) -> bool:
    return a.get_vocab() == b.get_vocab() and a.eos_token_id == b.eos_token_id


def load_models(recipe: Recipe, teacher_name: str, log: Callable[[str], None]):
    """``(student model, teacher model, tokenizer, student report)``; the teacher must share the
    student's tokenizer."""
    teacher = load_source(teacher_name)
    if recipe.plan is not None:
        result = convert(recipe.student, recipe.conversion_plan(), log=log, plan_path=recipe.plan)
        student, tokenizer, report = result.model, result.tokenizer, result.report_dict()
    else:
        loaded = load_source(recipe.student)
        student, tokenizer = loaded.model, loaded.tokenizer
        marker = loaded.path / OUTPUT_MARKER
        report = json.loads(marker.read_text()) if marker.is_file() else {"source": teacher_name, "stages": []}
    if not _same_tokenizer(tokenizer, teacher.tokenizer):
        raise RecipeError(f"teacher={teacher_name!r} has another tokenizer than student={recipe.student!r} "
                          "(vocabularies differ); token-level distillation needs the same one")
    return student, teacher.model, tokenizer, report


def held_out_sets(recipe: Recipe, tokenizer) -> tuple[dict, dict]:
    """The held-out token windows ``[N, T]`` and answer-check probes of every ``eval.texts``, by metric name."""
    ev = recipe.eval
    held_out, probes = {}, {}
    for t in ev.texts:  # tokenised once: the probes' filler is the first eval.answers windows
        windows = token_windows(tokenizer, resolve_text(t), ev.seq_len, max(ev.windows, ev.answers))
        held_out[_eval_name(t)] = windows[: ev.windows]
        if ev.answers:
            try:
                probes[_eval_name(t)] = make_probes(tokenizer, windows[: ev.answers], ev.answers)
            except ValueError as err:
                raise RecipeError(f"eval.answers={ev.answers} with eval.seq_len={ev.seq_len}: {err}") from None
    return held_out, probes


def indexer_loss(recipe: Recipe, model, teacher) -> tuple:
    """``(dense teacher, IndexerLoss)`` for a recipe with ``loss.indexer_steps`` / ``indexer_weight``;
    refused (RecipeError) when the student has no indexer, none of them trains, or the blocks are too
    short for any position to be selectable."""
    fields = "loss.indexer_steps / loss.indexer_weight"
    if not indexed_layers(model):
        raise RecipeError(f"{fields} need a CSA2 student with full or reindex layers (they have indexers); "
                          f"student={recipe.student!r} has none; set both to 0")
    shortest = shortest_block(model)
    if recipe.data.seq_len < shortest:
        raise RecipeError(f"{fields}: data.seq_len={recipe.data.seq_len} leaves the indexers nothing to pick "
                          f"(window + first tokens); use data.seq_len >= {shortest}")
    try:
        dense = dense_teacher(teacher)  # the same logits; its layers give the dense attention targets
    except ValueError as err:
        raise RecipeError(f"{fields}: {err}") from None
    indexer = IndexerLoss(model, dense)
    if not any(p.requires_grad for p in indexer.parameters()):
        raise RecipeError(f"{fields} train the indexers, which this recipe freezes (peft.train_surgery_parameters: "
                          "false, or trainable without them); let them train or set both to 0")
    return dense, indexer


def run_recipe(recipe: Recipe, out_dir: str | os.PathLike, *, resume: bool = False, overwrite: bool = False,
               log: Callable[[str], None] = print) -> dict:
    """Train ``recipe`` into ``out_dir`` (see the module docstring); returns the training report."""
    out = Path(out_dir).absolute()
    teacher_name, checkpoint = check_inputs(recipe, out, resume=resume, overwrite=overwrite)
    student, teacher, tokenizer, student_report = load_models(recipe, teacher_name, log)
    held_out, probes = held_out_sets(recipe, tokenizer)
    answer_writer = teacher  # the teacher itself: the indexer phase may wrap it below
    model, full_names = prepare_student(student, teacher, recipe)
    indexer = None
    if recipe.loss.uses_indexer:
        teacher, indexer = indexer_loss(recipe, model, teacher)
    args = training_arguments(recipe, out / "checkpoints")
    started = time.perf_counter()
    with args.main_process_first(desc="training data"):  # before --out is touched: data errors leave it as it was
        train_data = training_blocks(recipe.data, tokenizer, answers=recipe.loss.answer_weight != 1.0 or recipe.loss.on_policy > 0,
                                     teacher=answer_writer, tokens_needed=recipe.steps * recipe.batch
                                     * recipe.grad_accum * args.world_size * recipe.data.seq_len, log=log)
    if _rank() == 0 and not resume:
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        (out / OUTPUT_MARKER).write_text(json.dumps({"stages": [], "training": "in progress"}))
        (out / RECIPE_COPY).write_text(recipe.to_yaml())
    trainer = DistillationTrainer(
        model=model, args=args, train_dataset=train_data,
        eval_dataset=datasets.Dataset.from_dict({"input_ids": next(iter(held_out.values())).tolist()}),
        data_collator=default_data_collator, processing_class=tokenizer,
        teacher=teacher, held_out=held_out, loss=recipe.loss.kind, temperature=recipe.loss.temperature,
        lm_weight=recipe.loss.lm_weight, positions=recipe.loss.positions, answer_weight=recipe.loss.answer_weight, indexer=indexer, indexer_steps=recipe.loss.indexer_steps,
        indexer_weight=recipe.loss.indexer_weight, indexer_lr=recipe.optim.indexer_lr, probes=probes,
        on_policy=recipe.loss.on_policy, on_policy_tokens=recipe.loss.on_policy_tokens,
        adapter_extras=full_names if recipe.peft is not None else [])
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log(f"train: {len(train_data)} blocks of {recipe.data.seq_len} tokens; {trainable:,} trainable values "
        f"({len(full_names)} tensors in full{', + LoRA r=%d' % recipe.peft.r if recipe.peft else ''}); "
        f"teacher {teacher_name}")
    trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    if trainer.state.global_step % recipe.eval.every:
        trainer.evaluate()
    report = {
        "recipe": recipe.to_dict(), "student": recipe.student, "teacher": teacher_name,
        "world_size": args.world_size, "steps": trainer.state.global_step,
        "tokens_seen": trainer.state.global_step * recipe.batch * recipe.grad_accum * args.world_size
        * recipe.data.seq_len,
        "seconds": round(time.perf_counter() - started, 1), "resumed_from": str(checkpoint) if checkpoint else None,
        "trainable_values": trainable, "full_parameters": full_names, "teacher_answers": trainer.teacher_answers,
        "history": trainer.state.log_history,
    }
    if trainer.is_world_process_zero():
        write_outputs(trainer, recipe, tokenizer, student_report, report, out)
    return report


def write_outputs(trainer: DistillationTrainer, recipe: Recipe, tokenizer, student_report: dict, report: dict,
                  out: Path) -> None:
    model = trainer.accelerator.unwrap_model(trainer.model)
    merged_report = {**student_report, "uplift": {k: report[k] for k in ("recipe", "teacher", "steps", "tokens_seen")}}
    if recipe.peft is not None:
        model.save_pretrained(out / "adapter")
        save_adapter_extras(model, out / "adapter", trainer.adapter_extras)
        model = model.merge_and_unload()
    save_checkpoint(model, tokenizer, out / "merged", overwrite=True,
                    extra_files={OUTPUT_MARKER: json.dumps(merged_report, indent=2)})
    (out / REPORT).write_text(json.dumps(report, indent=2, default=str))
    write_curves(report["history"], out / "curves.png")
    (out / OUTPUT_MARKER).write_text(json.dumps({"stages": [], "training": "done"}))


def write_curves(history: list[dict], path: Path) -> Path | None:
    """Training loss and every held-out ratio against the optimizer step."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the eval extra is not installed: the JSON history has the same numbers
        return None
    fig, (ax_loss, ax_eval) = plt.subplots(1, 2, figsize=(10, 4))
    loss = [(h["step"], h["loss"]) for h in history if "loss" in h]
    if loss:
        ax_loss.plot(*zip(*loss))
    ax_loss.set(xlabel="step", ylabel="training loss")
    keys = sorted({k for h in history for k in h if k.endswith("_ppl_ratio")})
    for k in keys:
        pts = [(h["step"], h[k]) for h in history if k in h]
        ax_eval.plot(*zip(*pts), marker="o", label=k.removeprefix("eval_").removesuffix("_ppl_ratio"))
    ax_eval.axhline(1.0, color="grey", lw=0.5)
    ax_eval.set(xlabel="step", ylabel="held-out ppl / teacher's")
    if keys:
        ax_eval.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


__all__ = ["check_inputs", "load_models", "run_recipe", "write_curves", "write_outputs"]
