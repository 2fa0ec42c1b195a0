"""End-to-end distillation of a converted model toward its source (calibration, not training).

The per-layer fits and refinements each match one layer's output on the converted model's own
inputs; what the user sees is the next-token distribution at the top. This step trains a
chosen subset of the converted model's parameters (by default only those inside attention
modules: the parts the surgery rewrote) to minimise ``KL(source || converted)`` of the
next-token distributions over calibration windows. Only the source's outputs are targets,
never the text's own next tokens, so the converted model is pulled toward what the source
predicts, not taught the calibration domain. The last ``holdout`` windows are never trained
on and decide which state is kept (the start included; :class:`.held_out.BestState`).
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch
from torch.nn import functional as F

from .held_out import BestState

TRAINABLE = ("attention", "all")


def trainable_parameters(model: torch.nn.Module, which: str = "attention") -> list[torch.nn.Parameter]:
    """``attention``: the parameters inside each decoder layer's ``self_attn``; ``all``: every
    parameter except the (possibly tied) embeddings and output head."""
    if which not in TRAINABLE:
        raise ValueError(f"trainable={which!r}; allowed: {', '.join(TRAINABLE)}")
    if which == "attention":
        return [p for layer in model.model.layers for p in layer.self_attn.parameters()]
    skip = {id(p) for p in model.get_input_embeddings().parameters()}
    skip |= {id(p) for p in model.get_output_embeddings().parameters()}
    return [p for p in model.parameters() if id(p) not in skip]


def unshare_from(student: torch.nn.Module, teacher: torch.nn.Module, params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """Replace each of ``params`` whose storage ``teacher`` also uses by a copy, in every
    ``student`` module that holds it (conversions share the unchanged tensors with the source,
    see :mod:`.rebuild`; training them in place would move the teacher too). Returns the
    parameters to train, in order."""
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


def token_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(teacher || student) in nats; logits [N, T, V] (fp32 maths)."""
    t = F.log_softmax(teacher_logits.float(), dim=-1)
    s = F.log_softmax(student_logits.float(), dim=-1)
    return (t.exp() * (t - s)).sum(-1).mean()


def distill_to_source(student, teacher, windows: torch.Tensor, *, steps: int, lr: float = 1e-4, batch: int = 4,
                      holdout: int = 2, every: int = 10, trainable: str = "attention", seed: int = 0,
                      log: Callable[[str], None] | None = None) -> dict[str, float]:
    """Adam on ``KL(teacher || student)`` over ``windows`` [N, T] (token ids); in place on ``student``.

    Mini-batches of ``batch`` windows drawn from the first ``N - holdout``; every ``every`` steps
    (and at the end) the mean KL on the last ``holdout`` windows is measured, and the state with
    the lowest one is kept. ``teacher`` is only run under ``no_grad`` and never changed.
    Returns the held-out KL at the start and of the kept state, the kept step, and seconds.
    """
    n = windows.shape[0]
    if not 0 < holdout < n:
        raise ValueError(f"holdout={holdout}; allowed: 1..{n - 1} (there are {n} calibration windows)")
    if steps < 0 or lr <= 0 or batch < 1:
        raise ValueError(f"steps={steps}, lr={lr}, batch={batch}; allowed: steps >= 0, lr > 0, batch >= 1")
    params = unshare_from(student, teacher, trainable_parameters(student, trainable))
    started = time.perf_counter()
    train, held = windows[: n - holdout], windows[n - holdout :]
    trained = {id(p) for p in params}
    requires = {id(p): p.requires_grad for p in student.parameters()}

    @torch.no_grad()
    def teacher_logits(ids):
        return teacher(input_ids=ids, use_cache=False).logits

    held_targets = [teacher_logits(held[i : i + 1]) for i in range(held.shape[0])]

    @torch.no_grad()
    def held_kl() -> float:
        return sum(token_kl(t, student(input_ids=held[i : i + 1], use_cache=False).logits).item()
                   for i, t in enumerate(held_targets)) / len(held_targets)

    was_training = student.training
    student.eval()  # no dropout: the student must be the deterministic model that gets saved
    kept = BestState(params, held_kl())
    if log:
        log(f"distill: {len(params)} tensors ({sum(p.numel() for p in params):,} values) trainable; "
            f"held-out KL at start {kept.start:.4f}")
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(params, lr=lr)
    try:
        for p in student.parameters():
            p.requires_grad_(id(p) in trained)
        for step in range(1, steps + 1):
            ids = train[torch.randperm(train.shape[0], generator=gen)[:batch]]
            target = teacher_logits(ids)
            with torch.enable_grad():
                loss = token_kl(target, student(input_ids=ids, use_cache=False).logits)
                opt.zero_grad(set_to_none=True)
                loss.backward()
            if not math.isfinite(loss.item()):
                raise FloatingPointError(f"distillation loss is {loss.item()} at step {step}; lower lr (now {lr})")
            opt.step()
            if step % every == 0 or step == steps:
                score = held_kl()
                kept.offer(score, step)
                if log:
                    log(f"distill step {step}/{steps}: train KL {loss.item():.4f}, held-out KL {score:.4f} "
                        f"(best {kept.best:.4f} at step {kept.step}), {time.perf_counter() - started:.0f}s")
    finally:
        kept.restore()
        for p in student.parameters():
            p.requires_grad_(requires[id(p)])
        student.train(was_training)
    return {"distill_heldout_kl_before": kept.start, "distill_heldout_kl_after": kept.best,
            "distill_kept_step": kept.step, "distill_seconds": round(time.perf_counter() - started, 1)}


__all__ = ["TRAINABLE", "distill_to_source", "token_kl", "trainable_parameters", "unshare_from"]
