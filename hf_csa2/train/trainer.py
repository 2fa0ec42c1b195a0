"""The uplift engine: a transformers ``Trainer`` whose loss is distillation toward the teacher.

Everything a training loop needs beyond the loss comes from transformers/accelerate: the
optimiser and schedule, gradient accumulation, clipping, checkpoints that resume to the same
losses, and several processes (``torchrun --nproc_per_node N -m hf_csa2 train ...`` or
``accelerate launch``). What this module adds:

* :func:`distillation_loss` -- forward KL to the teacher's next-token distribution, the plain LM
  loss, or a mix;
* evaluation as the held-out perplexity ratio to the teacher on fixed windows of each
  ``eval.texts`` (the teacher's NLL measured once);
* which parameters train: LoRA (PEFT) on the attention projections the student shares with its
  teacher, and the parameters the surgery created or reshaped trained in full (they are written
  into the adapter file, so ``PeftModel.from_pretrained`` and ``--resume`` restore them too).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from torch.nn import functional as F
from transformers import Trainer, TrainingArguments, set_seed

from ..metrics.perplexity import mean_nll
from ..surgery.distill import trainable_parameters
from .recipe import LossSpec, PeftSpec, Recipe

ADAPTER_FILE = "adapter_model.safetensors"


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor | None, input_ids: torch.Tensor,
                      spec: LossSpec) -> torch.Tensor:
    """Mean per-token loss of next-token predictions; logits ``[B, T, V]``, ``input_ids`` ``[B, T]``.

    ``kd``: KL(teacher_T || student_T) * T^2 with both softmaxes at temperature T (positions
    0..T-1 predict tokens 1..T, as in the LM loss); ``lm``: cross-entropy on ``input_ids[:, 1:]``;
    ``kd+lm``: ``(1 - w) kd + w lm``. Maths in fp32.
    """
    s = student_logits[:, :-1].float()
    terms = {}
    if spec.kind in ("kd", "kd+lm"):
        t = teacher_logits[:, :-1].float()
        temp = spec.temperature
        log_t = F.log_softmax(t / temp, dim=-1)
        log_s = F.log_softmax(s / temp, dim=-1)
        terms["kd"] = (log_t.exp() * (log_t - log_s)).sum(-1).mean() * temp ** 2
    if spec.kind in ("lm", "kd+lm"):
        terms["lm"] = F.cross_entropy(s.reshape(-1, s.shape[-1]), input_ids[:, 1:].reshape(-1))
    if spec.kind == "kd+lm":
        return (1 - spec.lm_weight) * terms["kd"] + spec.lm_weight * terms["lm"]
    return terms[spec.kind]


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
    ``recipe.peft`` is set, else ``student`` with ``recipe.trainable`` parameters trainable.
    Returns ``(model, full_names)``: ``full_names`` are the base-model parameter names trained in full."""
    surgery = surgery_parameter_names(student, teacher)
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


def save_full_parameters(model, adapter_dir: str | Path, full_names: list[str]) -> None:
    """Add the parameters trained in full beside LoRA to the adapter's safetensors file under their
    PeftModel names; PEFT's loader (``load_state_dict(strict=False)`` of that file) puts them back."""
    if not full_names:
        return
    path = Path(adapter_dir) / ADAPTER_FILE
    tensors = load_file(str(path))
    base = model.get_base_model()
    for n in full_names:
        tensors[f"base_model.model.{n}"] = base.get_parameter(n).detach().cpu().contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})


class UpliftTrainer(Trainer):
    """``Trainer`` with a distillation loss, a frozen teacher, and held-out ppl-ratio evaluation."""

    def __init__(self, *args, teacher, loss: LossSpec, held_out: dict[str, torch.Tensor],
                 adapter_extras: list[str] = (), **kwargs):
        super().__init__(*args, **kwargs)
        self.teacher = teacher.eval()
        for p in self.teacher.parameters():
            p.requires_grad_(False)
        self.loss_spec = loss
        self.held_out = held_out
        self.adapter_extras = list(adapter_extras)  # parameters trained in full beside LoRA: saved in the adapter file
        self.teacher_nll = {name: mean_nll(self.teacher, w)["nll"] for name, w in held_out.items()}
        self.model_accepts_loss_kwargs = False  # our loss is a per-token mean: Trainer scales it for accumulation

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        ids = inputs["input_ids"]
        out = model(input_ids=ids, use_cache=False)
        teacher_logits = None
        if self.loss_spec.kind != "lm":
            with torch.no_grad():
                teacher_logits = self.teacher(input_ids=ids, use_cache=False).logits
        loss = distillation_loss(out.logits, teacher_logits, ids, self.loss_spec)
        return (loss, out) if return_outputs else loss

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        model = self.accelerator.unwrap_model(self.model)
        metrics = {}
        for name, windows in self.held_out.items():
            nll = mean_nll(model, windows)["nll"]
            metrics[f"{metric_key_prefix}_{name}_ppl_ratio"] = math.exp(nll - self.teacher_nll[name])
            metrics[f"{metric_key_prefix}_{name}_kl"] = self._held_out_kl(model, windows)
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    @torch.no_grad()
    def _held_out_kl(self, model, windows: torch.Tensor) -> float:
        """Mean per-token KL(teacher || student) of next-token distributions over ``windows``."""
        was_training = model.training
        model.eval()
        try:
            kd = LossSpec(kind="kd")
            total = sum(float(distillation_loss(model(input_ids=w[None], use_cache=False).logits,
                                                self.teacher(input_ids=w[None], use_cache=False).logits, w[None], kd))
                        for w in windows.to(self.args.device))
        finally:
            model.train(was_training)
        return total / len(windows)

    def _save(self, output_dir: str | None = None, state_dict=None):
        super()._save(output_dir, state_dict)
        if self.adapter_extras and self.args.should_save:
            save_full_parameters(self.accelerator.unwrap_model(self.model), output_dir or self.args.output_dir,
                                 self.adapter_extras)


def training_arguments(recipe: Recipe, output_dir: str | Path) -> TrainingArguments:
    """transformers ``TrainingArguments`` mirroring the recipe (CPU runs use the gloo backend)."""
    cpu = not torch.cuda.is_available()
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    return TrainingArguments(
        output_dir=str(output_dir),
        max_steps=recipe.steps,
        per_device_train_batch_size=recipe.batch,
        gradient_accumulation_steps=recipe.grad_accum,
        learning_rate=recipe.optim.lr,
        weight_decay=recipe.optim.weight_decay,
        max_grad_norm=recipe.optim.max_grad_norm,
        lr_scheduler_type=recipe.schedule.kind,
        warmup_steps=recipe.schedule.warmup_steps,
        optim="adamw_torch",
        logging_steps=recipe.log_every,
        eval_strategy="steps",
        eval_steps=recipe.eval.every,
        save_strategy="steps",
        save_steps=recipe.save.every,
        save_total_limit=recipe.save.keep,
        seed=recipe.seed,
        data_seed=recipe.seed,
        report_to=[],
        use_cpu=cpu,
        ddp_backend="gloo" if cpu and several else None,
        ddp_find_unused_parameters=True,  # indexers and routed parts get no gradient on some steps
        dataloader_drop_last=True,
        remove_unused_columns=False,
        save_only_model=False,
    )


__all__ = ["UpliftTrainer", "default_lora_targets", "distillation_loss", "prepare_student", "save_full_parameters",
           "surgery_parameter_names", "training_arguments"]
