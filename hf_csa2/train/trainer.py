"""What ``hf-csa2 train`` adds to the shared engine (:mod:`hf_csa2.engine.trainer`): which
parameters a recipe trains -- LoRA (PEFT) on the attention projections the student shares with
its teacher, the parameters the surgery created or reshaped in full beside it, or chosen modules
in full -- and the ``TrainingArguments`` a recipe maps to."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import TrainingArguments, set_seed

from ..engine.trainer import layout_zeros, trainable_parameters, trainer_arguments
from .recipe import PeftSpec, Recipe, RecipeError


def surgery_parameter_names(student: torch.nn.Module, teacher: torch.nn.Module) -> list[str]:
    """Names of the student's parameters the surgery created or reshaped: absent from the teacher,
    or there with another shape (e.g. MLA's latent projections, sinks, CSA2 readers and indexers, an
    MQA k_proj)."""
    theirs = {n: p.shape for n, p in teacher.named_parameters()}
    return [n for n, p in student.named_parameters() if theirs.get(n) != p.shape]


def default_lora_targets(student: torch.nn.Module, surgery: list[str]) -> list[str]:
    """Full names of the linear layers inside ``self_attn`` modules whose weights the student
    shares with its teacher (the surgery-made ones are trained in full instead)."""
    made = set(surgery)
    return [name for name, m in student.named_modules()
            if isinstance(m, torch.nn.Linear) and ".self_attn." in f".{name}." and f"{name}.weight" not in made]


def prepare_student(student, teacher, recipe: Recipe):
    """The model the Trainer trains: a PeftModel (LoRA + the surgery parameters in full) when
    ``recipe.peft`` is set, else ``student`` with ``recipe.trainable`` parameters trainable;
    never the parameters :func:`layout_zeros` names. Returns ``(model, full_names)``: the
    base-model parameter names trained in full."""
    frozen = layout_zeros(student)
    surgery = [n for n in surgery_parameter_names(student, teacher) if n not in frozen]
    for p in student.parameters():
        p.requires_grad_(False)
    if recipe.peft is None:
        chosen = {id(p) for p in trainable_parameters(student, recipe.trainable)}
        names = [n for n, p in student.named_parameters() if id(p) in chosen]
        for n in names:
            student.get_parameter(n).requires_grad_(True)
        return student, names
    return _with_lora(student, recipe.peft, surgery, recipe.seed)


def _with_lora(student, spec: PeftSpec, surgery: list[str], seed: int):
    targets = spec.target_modules or default_lora_targets(student, surgery)
    if not targets:
        raise ValueError("no linear layer inside self_attn is shared with the teacher; set peft.target_modules "
                         "or peft: null (train the attention in full)")
    if spec.layers is not None:
        targets = in_layers(student, targets, spec.layers)
    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=targets,
                        bias="none", task_type="CAUSAL_LM")
    set_seed(seed)  # LoRA's A matrices are drawn here: the same recipe gives the same adapter in every process
    model = get_peft_model(student, config)
    full = []
    if spec.train_surgery_parameters:
        base = model.get_base_model()
        for n in surgery:
            try:
                p = base.get_parameter(n)
            except AttributeError:  # inside a layer LoRA wraps (peft.target_modules): its base weight stays frozen
                continue
            p.requires_grad_(True)
            full.append(n)
    return model, full


def in_layers(student: torch.nn.Module, targets: list[str], layers: list[int]) -> list[str]:
    """Full names of the modules named by ``targets`` (full names or name suffixes, as PEFT matches
    them) inside decoder layers ``layers``. (PEFT's ``layers_to_transform`` does not apply to targets
    given by full name, so the layers are chosen here.)"""
    count = len(student.model.layers)
    if max(layers) >= count:
        raise RecipeError(f"recipe.peft.layers={layers}: the student has {count} decoder layers (0..{count - 1})")
    chosen = {f"model.layers.{i}." for i in layers}
    names = [name for name, _ in student.named_modules()
             if any(name == t or name.endswith(f".{t}") for t in targets) and any(c in f"{name}." for c in chosen)]
    if not names:
        raise RecipeError(f"recipe.peft.layers={layers}: none of the LoRA targets ({', '.join(targets)}) is in "
                          "those layers")
    return names


def training_arguments(recipe: Recipe, output_dir: str | Path) -> TrainingArguments:
    """transformers ``TrainingArguments`` mirroring the recipe."""
    return trainer_arguments(
        output_dir, steps=recipe.steps, batch=recipe.batch, grad_accum=recipe.grad_accum, lr=recipe.optim.lr,
        weight_decay=recipe.optim.weight_decay, max_grad_norm=recipe.optim.max_grad_norm,
        schedule=recipe.schedule.kind, warmup_steps=recipe.schedule.warmup_steps, log_every=recipe.log_every,
        eval_every=recipe.eval.every, save_every=recipe.save.every, save_keep=recipe.save.keep, seed=recipe.seed)


__all__ = ["default_lora_targets", "in_layers", "prepare_student", "surgery_parameter_names", "training_arguments"]
