"""Distillation on a transformers ``Trainer``: one training code path for the convert pipeline's
distillation stage, ``hf-csa2 distill`` and ``hf-csa2 train``.

Everything a training loop needs beyond the loss comes from transformers/accelerate: the
optimiser and schedule, gradient accumulation, clipping, checkpoints that resume to the same
losses, and several processes (``torchrun`` / ``accelerate launch``). What this module adds:

* :func:`distillation_loss` -- forward KL to the teacher's next-token distribution, the plain LM
  loss, or a mix;
* evaluation on fixed held-out windows: the perplexity ratio to the teacher and the mean token
  KL(teacher || student) (the teacher's NLL is measured once), also before the first step;
* :class:`KeepBest` -- keep the state with the lowest held-out KL (the start included);
* which parameters train (:func:`trainable_parameters`) and copies of the ones the student
  shares with its teacher (:func:`unshare_from`), so training never moves the teacher.
"""

from __future__ import annotations

import functools
import math
import os
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.nn import functional as F
from transformers import Trainer, TrainerCallback, TrainingArguments

from ..formats import export_problems
from ..metrics.answer_check import answer_check
from ..metrics.perplexity import mean_nll
from .held_out import BestState

LOSSES = ("kd", "kd+lm", "lm")
TRAINABLE = ("attention", "all")
ADAPTER_FILE = "adapter_model.safetensors"
INDEX_LOSS = "index_loss"  # the key of an indexer loss in the student's output (hf_csa2.train.indexer_phase)


def _mean(values: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    return values.mean() if weights is None else (values * weights).sum() / weights.sum()


def token_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float = 1.0,
             weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over tokens of KL(teacher_T || student_T) in nats, scaled by T^2; logits [..., V], fp32 maths.
    ``weights`` ([...], the logits' leading shape): a weighted mean instead."""
    t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    return _mean((t.exp() * (t - s)).sum(-1), weights) * temperature ** 2


def answer_weights(answer_mask: torch.Tensor, weight: float, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Per-prediction weights ``[B, T-1]`` (``[B, N]`` at ``positions``) from a block's ``answer_mask``
    ``[B, T]``: ``weight`` where the predicted token is an answer token, 1 elsewhere."""
    targets = answer_mask[:, 1:] if positions is None else answer_mask[:, positions + 1]
    return 1.0 + (weight - 1.0) * targets.float()


def last_answer_start(answer_mask: torch.Tensor) -> int | None:
    """Index of the first token of the last run of answer tokens in one block's ``answer_mask``
    ``[T]`` that has something before it to answer (a run at position 0 is the tail of an exchange
    packed into the block before); None when there is none."""
    m = answer_mask.bool()
    starts = (m[1:] & ~m[:-1]).nonzero().flatten() + 1
    return int(starts[-1]) if len(starts) else None


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor | None, input_ids: torch.Tensor,
                      kind: str = "kd", temperature: float = 1.0, lm_weight: float = 0.5,
                      positions: torch.Tensor | None = None, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean per-token loss of next-token predictions; logits ``[B, T, V]``, ``input_ids`` ``[B, T]``.

    ``kd``: :func:`token_kl` at ``temperature`` over positions 0..T-2 (those that predict a token
    of the window, as in the LM loss); ``lm``: cross-entropy on ``input_ids[:, 1:]``; ``kd+lm``:
    ``(1 - lm_weight) * kd + lm_weight * lm``. With ``positions`` (``[N]``, each < T-1) the logits
    are ``[B, N, V]``, taken at those positions only (``logits_to_keep=positions``), and the LM
    targets are the tokens after them. ``weights`` (``[B, T-1]``, or ``[B, N]`` with positions, e.g.
    :func:`answer_weights`): weighted means instead of plain ones.
    """
    if kind not in LOSSES:
        raise ValueError(f"loss kind={kind!r}; allowed: {', '.join(LOSSES)}")
    if positions is None:
        s, t, targets = student_logits[:, :-1], None if teacher_logits is None else teacher_logits[:, :-1], input_ids[:, 1:]
    else:
        s, t, targets = student_logits, teacher_logits, input_ids[:, positions + 1]
    terms = {}
    if kind in ("kd", "kd+lm"):
        terms["kd"] = token_kl(t, s, temperature, weights)
    if kind in ("lm", "kd+lm"):
        terms["lm"] = _mean(F.cross_entropy(s.float().reshape(-1, s.shape[-1]), targets.reshape(-1),
                                            reduction="none"), None if weights is None else weights.reshape(-1))
    if kind == "kd+lm":
        return (1 - lm_weight) * terms["kd"] + lm_weight * terms["lm"]
    return terms[kind]


def layout_zeros(model: torch.nn.Module) -> set[str]:
    """Parameters that must stay zero for ``model`` to keep its export format: a DeepSeek-V3
    exportable MLA model has up-projection biases only as zeros (stock DeepSeek-V3 has none)."""
    if getattr(model.config, "model_type", None) != "hf_csa2" or export_problems(model):
        return set()
    return {n for n, p in model.named_parameters() if n.endswith("kv_b_proj.bias") and not p.any()}


def trainable_parameters(model: torch.nn.Module, which: str = "attention") -> list[torch.nn.Parameter]:
    """``attention``: the parameters inside each decoder layer's ``self_attn``; ``all``: every
    parameter except the (possibly tied) embeddings and output head. Never the
    :func:`layout_zeros`: training must not cost a checkpoint its export format."""
    if which not in TRAINABLE:
        raise ValueError(f"trainable={which!r}; allowed: {', '.join(TRAINABLE)}")
    skip = {id(model.get_parameter(n)) for n in layout_zeros(model)}
    if which == "attention":
        return [p for layer in model.model.layers for p in layer.self_attn.parameters() if id(p) not in skip]
    skip |= {id(p) for p in model.get_input_embeddings().parameters()}
    skip |= {id(p) for p in model.get_output_embeddings().parameters()}
    return [p for p in model.parameters() if id(p) not in skip]


def unshare_from(student: torch.nn.Module, teacher: torch.nn.Module, params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """Replace each of ``params`` whose storage ``teacher`` also uses by a copy, in every
    ``student`` module that holds it (conversions share the unchanged tensors with the source;
    training them in place would move the teacher too). Returns the parameters to train, in order."""
    taken = {p.untyped_storage().data_ptr() for p in teacher.parameters()}
    copies: dict[int, torch.nn.Parameter] = {}
    for p in params:
        if p.untyped_storage().data_ptr() in taken:
            copies[id(p)] = torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
    if copies:
        for module in student.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                if id(p) in copies:
                    module.register_parameter(name, copies[id(p)])
    return [copies.get(id(p), p) for p in params]


def save_adapter_extras(model, adapter_dir: str | Path, names: list[str]) -> None:
    """Add parameters trained in full beside LoRA to a PEFT adapter's safetensors file under their
    PeftModel names; PEFT's loader (``load_state_dict(strict=False)`` of that file) puts them back."""
    if not names:
        return
    path = Path(adapter_dir) / ADAPTER_FILE
    tensors = load_file(str(path))
    base = model.get_base_model()
    for n in names:
        tensors[f"base_model.model.{n}"] = base.get_parameter(n).detach().cpu().contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})


def trainer_arguments(output_dir: str | Path, *, steps: int, batch: int, lr: float, grad_accum: int = 1,
                      weight_decay: float = 0.0, max_grad_norm: float = 0.0, schedule: str = "constant",
                      warmup_steps: int = 0, log_every: int = 10, eval_every: int = 50,
                      save_every: int | None = None, save_keep: int = 2, seed: int = 0,
                      progress: bool = True) -> TrainingArguments:
    """``TrainingArguments`` for a distillation run (AdamW; ``max_grad_norm`` 0: no clipping;
    ``save_every`` None: no checkpoints). Several processes on CPU use the gloo backend."""
    cpu = not torch.cuda.is_available()
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    return TrainingArguments(
        output_dir=str(output_dir), max_steps=steps, per_device_train_batch_size=batch,
        gradient_accumulation_steps=grad_accum, learning_rate=lr, weight_decay=weight_decay,
        max_grad_norm=max_grad_norm, lr_scheduler_type=schedule, warmup_steps=warmup_steps, optim="adamw_torch",
        logging_steps=log_every, eval_strategy="steps", eval_steps=eval_every,
        save_strategy="steps" if save_every else "no", save_steps=save_every or 500, save_total_limit=save_keep,
        seed=seed, data_seed=seed, report_to=[], use_cpu=cpu, ddp_backend="gloo" if cpu and several else None,
        ddp_find_unused_parameters=True,  # indexers and routed parts get no gradient on some steps
        dataloader_drop_last=True, remove_unused_columns=False, disable_tqdm=not progress,
    )


class DistillationTrainer(Trainer):
    """``Trainer`` with a distillation loss toward a frozen teacher and held-out evaluation.

    ``held_out``: name -> token windows ``[N, T]``; every evaluation logs
    ``eval_<name>_ppl_ratio`` and ``eval_<name>_kl``; ``probes``: name -> answer-check probes
    (:func:`~hf_csa2.metrics.answer_check.make_probes`), logged as ``eval_<name>_answers_far`` /
    ``_near`` (the teacher's, measured once, are in ``teacher_answers``). ``adapter_extras``: parameters trained in
    full beside LoRA, written into every saved adapter file (checkpoints included, so
    ``resume_from_checkpoint`` restores them too).

    ``indexer``: an :class:`~hf_csa2.train.indexer_phase.IndexerLoss` on the student and this
    ``teacher`` (None: no indexer loss). The first ``indexer_steps`` optimizer steps train the
    indexers alone on it (every other parameter frozen during the forward, at a constant rate); the
    learning-rate schedule (warm-up included) then starts for the distillation steps, which add the
    indexer loss with ``indexer_weight`` (0: the indexers stay as they are). Indexers get no other
    gradient, so under AdamW their step size is ``indexer_lr`` (None: the run's rate), whatever the
    weight; the weight sets the indexer loss's share of the gradient norm that clipping bounds.

    ``positions``: score the loss on that many positions per block, drawn anew for every
    micro-batch (torch's global generator, which checkpoints restore); teacher and student compute
    logits there only (``logits_to_keep``). An unbiased estimate of the all-position loss at a
    fraction of the output head's and the KL's cost (None: every position).

    ``answer_weight``: the loss on predictions of answer tokens (the batches' ``answer_mask``, from
    :func:`hf_csa2.train.data.training_blocks` with ``answers``) weighs this many times a context
    token's, in a weighted mean (1: every token alike, no mask needed).

    ``on_policy``: the share of micro-batches (drawn with torch's global generator, which checkpoints
    restore) on which the student writes the answers itself (GKD, Agarwal et al. 2024): each block
    is cut before its last answer (:func:`last_answer_start`), the student continues it greedily for at
    most ``on_policy_tokens`` tokens (stopped at its end-of-turn), and the loss is the token KL to the
    teacher on the written tokens alone (the context is scored on the other micro-batches). The
    teacher so corrects the student in the states its own decoding reaches (loops, drift to the
    passage's topic), which the passage's answer never visits. Blocks without an answer keep the usual loss; these micro-batches score every
    position and leave out the indexer loss.
    """

    def __init__(self, *args, teacher, held_out: dict[str, torch.Tensor], loss: str = "kd",
                 temperature: float = 1.0, lm_weight: float = 0.5, positions: int | None = None,
                 answer_weight: float = 1.0, adapter_extras: list[str] = (),
                 evaluate_at_start: bool = True, indexer=None, indexer_steps: int = 0,
                 indexer_weight: float = 0.0, indexer_lr: float | None = None, probes: dict[str, list] | None = None,
                 on_policy: float = 0.0, on_policy_tokens: int = 32, **kwargs):
        super().__init__(*args, **kwargs)
        self.teacher = teacher.eval()
        for p in self.teacher.parameters():
            p.requires_grad_(False)
        self.loss_kind, self.temperature, self.lm_weight = loss, temperature, lm_weight
        self.positions = positions
        self.answer_weight = answer_weight
        self.indexer, self.indexer_steps, self.indexer_weight = indexer, indexer_steps, indexer_weight
        self.indexer_lr = indexer_lr
        if on_policy and loss != "kd":
            raise ValueError(f"on_policy={on_policy} needs loss kd (the teacher's distribution over the student's "
                             f"own tokens), not {loss!r}: an lm loss would train the student on what it wrote")
        self.on_policy, self.on_policy_tokens = on_policy, on_policy_tokens
        self._policy_sum, self._policy_count = 0.0, 0  # the on-policy loss since the last log line
        self._index_sum, self._index_count = 0.0, 0  # the indexer loss since the last log line
        self.held_out = held_out
        self.adapter_extras = list(adapter_extras)
        self.teacher_nll = {name: mean_nll(self.teacher, w)["nll"] for name, w in held_out.items()}
        self.probes = dict(probes or {})
        self.teacher_answers = {name: answer_check(self.teacher, p).to_dict() for name, p in self.probes.items()}
        self.model_accepts_loss_kwargs = False  # our loss is a per-token mean: Trainer scales it for accumulation
        if evaluate_at_start:
            self.add_callback(_EvaluateAtStart(self))

    def in_indexer_phase(self) -> bool:
        """Whether the current step trains the indexers alone."""
        return self.indexer is not None and self.state.global_step < self.indexer_steps

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        ids = inputs["input_ids"]
        alone = self.in_indexer_phase()
        if self.on_policy and not alone and float(torch.rand(())) < self.on_policy:
            loss = self.on_policy_loss(model, ids, inputs["answer_mask"])
            if loss is not None:
                self._policy_sum += float(loss.detach())
                self._policy_count += 1
                return (loss, None) if return_outputs else loss
        index = self.indexer is not None and (alone or self.indexer_weight > 0)
        teacher_logits = None
        scored = self.scored_positions(ids.shape[1], ids.device)
        keep = {} if scored is None else {"logits_to_keep": scored}
        if alone:  # the teacher's layers give the targets; its logits are not needed
            with torch.no_grad(), self.indexer.teacher_targets():
                self.teacher.model(input_ids=ids, use_cache=False)
        elif index or self.loss_kind != "lm":
            with torch.no_grad(), self.indexer.teacher_targets() if index else nullcontext():
                teacher_logits = self.teacher(input_ids=ids, use_cache=False, **keep).logits
        with self.indexer.active() if index else nullcontext(), \
                training_only(model, self.indexer.parameters()) if alone else nullcontext():
            out = model(input_ids=ids, use_cache=False, **({} if alone else keep))
        if alone:
            loss = out[INDEX_LOSS]
        else:
            weights = None if self.answer_weight == 1.0 else answer_weights(inputs["answer_mask"], self.answer_weight, scored)
            loss = distillation_loss(out.logits, teacher_logits, ids, self.loss_kind, self.temperature, self.lm_weight,
                                     positions=scored, weights=weights)
            if index:
                loss = loss + self.indexer_weight * out[INDEX_LOSS]
        if index:
            self._index_sum += float(out[INDEX_LOSS].detach())
            self._index_count += 1
        if not torch.isfinite(loss):
            raise FloatingPointError(f"training loss is {loss.item()} at step {self.state.global_step + 1}; "
                                     f"lower the learning rate (now {self.args.learning_rate})")
        return (loss, out) if return_outputs else loss

    @torch.no_grad()
    def student_answers(self, model, ids: torch.Tensor, answer_mask: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
        """Per block with an answer: ``(sequence, start)``, the block up to its last answer's
        ``start`` followed by the student's greedy continuation (at most ``on_policy_tokens`` tokens,
        its end-of-turn kept when it writes one)."""
        student = self.accelerator.unwrap_model(model)
        config = student.generation_config
        stop = config.eos_token_id
        pad = config.pad_token_id if config.pad_token_id is not None else (
            stop[0] if isinstance(stop, (list, tuple)) else stop)
        was_training = student.training
        student.eval()
        try:
            rows = []
            for row, mask in zip(ids, answer_mask):
                start = last_answer_start(mask)
                if start is None:
                    continue
                out = student.generate(input_ids=row[None, :start], attention_mask=torch.ones_like(row[None, :start]),
                                       do_sample=False, max_new_tokens=self.on_policy_tokens, eos_token_id=stop,
                                       pad_token_id=pad)
                rows.append((out[0], start))
            return rows
        finally:
            student.train(was_training)

    def on_policy_loss(self, model, ids: torch.Tensor, answer_mask: torch.Tensor) -> torch.Tensor | None:
        """Mean over blocks whose last answer the student wrote (:meth:`student_answers`) of the token
        KL(teacher || student) on the written tokens alone; None when no block has an answer."""
        rows = self.student_answers(model, ids, answer_mask)
        if not rows:
            return None
        losses = []
        for seq, start in rows:
            keep = len(seq) - start + 1  # the positions that predict the written tokens, and the last
            with torch.no_grad():
                teacher_logits = self.teacher(input_ids=seq[None], use_cache=False, logits_to_keep=keep).logits
            student_logits = model(input_ids=seq[None], use_cache=False, logits_to_keep=keep).logits
            losses.append(token_kl(teacher_logits[:, :-1], student_logits[:, :-1], self.temperature))
        loss = torch.stack(losses).mean()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"on-policy loss is {loss.item()} at step {self.state.global_step + 1}; "
                                     f"lower the learning rate (now {self.args.learning_rate})")
        return loss

    def scored_positions(self, length: int, device) -> torch.Tensor | None:
        """Sorted positions ``[positions]`` of a ``length``-token block the loss is scored on (each
        predicts a token of the block); None: all of them."""
        if self.positions is None or self.positions >= length - 1:
            return None
        return torch.randperm(length - 1)[: self.positions].sort().values.to(device)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Training log lines also carry ``index_kl``, the mean indexer loss since the last line, and
        ``on_policy_kl``, the mean loss of the on-policy micro-batches since then."""
        if "loss" in logs and self._index_count:
            logs["index_kl"] = self._index_sum / self._index_count
            self._index_sum, self._index_count = 0.0, 0
        if "loss" in logs and self._policy_count:
            logs["on_policy_kl"] = self._policy_sum / self._policy_count
            self._policy_sum, self._policy_count = 0.0, 0
        super().log(logs, start_time)

    def create_optimizer(self, model=None):
        """AdamW as the Trainer builds it; with ``indexer_lr`` the indexer parameters in groups of their own."""
        made = self.optimizer is None
        optimizer = super().create_optimizer(model)
        if made and self.indexer is not None and self.indexer_lr is not None:
            ids = {id(p) for p in self.indexer.parameters()}
            groups = []
            for group in optimizer.param_groups:
                mine = [p for p in group["params"] if id(p) in ids]
                group["params"] = [p for p in group["params"] if id(p) not in ids]
                if mine:
                    groups.append({**group, "params": mine, "lr": self.indexer_lr})
            optimizer.param_groups = [g for g in optimizer.param_groups if g["params"]]
            for group in groups:
                optimizer.add_param_group(group)
        return optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """With indexer steps: a constant rate during them, then the recipe's schedule (warm-up, then
        cosine / linear / constant decay) over the distillation steps."""
        if self.indexer is None or not self.indexer_steps or self.lr_scheduler is not None:
            return super().create_scheduler(num_training_steps, optimizer)
        factor = functools.partial(two_stage_factor, first=self.indexer_steps, total=num_training_steps,
                                   warmup=self.args.get_warmup_steps(num_training_steps - self.indexer_steps),
                                   kind=str(self.args.lr_scheduler_type.value))
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer or self.optimizer, factor)
        self._created_lr_scheduler = True
        return self.lr_scheduler

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        model = self.accelerator.unwrap_model(self.model)
        metrics = {}
        for name, windows in self.held_out.items():
            nll = mean_nll(model, windows)["nll"]
            metrics[f"{metric_key_prefix}_{name}_ppl_ratio"] = math.exp(nll - self.teacher_nll[name])
            metrics[f"{metric_key_prefix}_{name}_kl"] = self.held_out_kl(model, windows)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PeftModel's LoRA stays in
        for name, probes in self.probes.items():
            check = answer_check(base, probes)
            metrics[f"{metric_key_prefix}_{name}_answers_far"] = check.far
            metrics[f"{metric_key_prefix}_{name}_answers_near"] = check.near
            metrics[f"{metric_key_prefix}_{name}_answer_nll"] = check.answer_nll
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    @torch.no_grad()
    def held_out_kl(self, model, windows: torch.Tensor) -> float:
        """Mean per-token KL(teacher || student) of next-token distributions over ``windows``."""
        was_training = model.training
        model.eval()
        try:
            total = 0.0
            for w in windows.to(self.args.device):
                s = model(input_ids=w[None], use_cache=False).logits
                t = self.teacher(input_ids=w[None], use_cache=False).logits
                total += float(distillation_loss(s, t, w[None], "kd"))
        finally:
            model.train(was_training)
        return total / len(windows)

    def _save(self, output_dir: str | None = None, state_dict=None):
        super()._save(output_dir, state_dict)
        if self.adapter_extras and self.args.should_save:
            save_adapter_extras(self.accelerator.unwrap_model(self.model), output_dir or self.args.output_dir,
                                self.adapter_extras)


def two_stage_factor(step: int, *, first: int, total: int, warmup: int, kind: str) -> float:
    """Learning-rate factor at optimizer ``step``: 1 for the first ``first`` steps, then the
    ``kind`` schedule (``cosine``, ``linear`` or ``constant``, after ``warmup`` linear warm-up steps,
    transformers' conventions) over the remaining ``total - first`` steps."""
    if step < first:
        return 1.0
    s, n = step - first, max(1, total - first)
    if s < warmup:
        return s / max(1, warmup)
    if kind == "constant":
        return 1.0
    if kind == "linear":
        return max(0.0, (n - s) / max(1, n - warmup))
    if kind == "cosine":
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * (s - warmup) / max(1, n - warmup))))
    raise ValueError(f"schedule kind={kind!r}; allowed: cosine, linear, constant")


@contextmanager
def training_only(model: torch.nn.Module, keep: list[torch.nn.Parameter]):
    """Within: of ``model``'s trainable parameters only ``keep`` take part in the autograd graph; the
    others are frozen and get their flag back on exit (a graph built inside keeps what it saw)."""
    kept = {id(p) for p in keep}
    frozen = [p for p in model.parameters() if p.requires_grad and id(p) not in kept]
    for p in frozen:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(True)


class _EvaluateAtStart(TrainerCallback):
    """The held-out figures before the first step, in the run's own log history (``train`` starts a
    new state, so an ``evaluate`` called before it would not be kept)."""

    def __init__(self, trainer: DistillationTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step == 0:
            self.trainer.evaluate()


class KeepBest(TrainerCallback):
    """Keep the parameters' state with the lowest ``metric`` seen at an evaluation (the state before
    the first step included, when it is evaluated); restored when training ends."""

    def __init__(self, parameters: list[torch.nn.Parameter], metric: str):
        self.parameters, self.metric = list(parameters), metric
        self.kept: BestState | None = None

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        score = (metrics or {}).get(self.metric)
        if score is None:
            return
        if self.kept is None:
            self.kept = BestState(self.parameters, score)
            self.kept.step = state.global_step
        else:
            self.kept.offer(score, state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if self.kept is not None:
            self.kept.restore()


__all__ = ["ADAPTER_FILE", "DistillationTrainer", "INDEX_LOSS", "KeepBest", "LOSSES", "TRAINABLE", "distillation_loss", "layout_zeros",
           "save_adapter_extras", "token_kl", "trainable_parameters", "trainer_arguments", "training_only", "two_stage_factor", "unshare_from"]
