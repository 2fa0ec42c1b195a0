"""End-to-end distillation of a converted model toward its source (calibration, not training).

The per-layer fits and refinements each match one layer's output on the converted model's own
inputs; what the user sees is the next-token distribution at the top. This step trains a
chosen subset of the converted model's parameters (by default only those inside attention
modules: the parts the surgery rewrote) to minimise ``KL(source || converted)`` of the
next-token distributions over calibration windows, on the same engine as ``hf-csa2 train``
(:mod:`hf_csa2.engine.trainer`, a transformers ``Trainer``). Only the source's outputs are
targets, never the text's own next tokens, so the converted model is pulled toward what the
source predicts, not taught the calibration domain. The last ``holdout`` windows are never
trained on and decide which state is kept (the start included; :class:`.KeepBest`).
"""

from __future__ import annotations

import tempfile
import time
from typing import Callable

import datasets
import torch
from transformers import PrinterCallback, TrainerCallback, default_data_collator

from ..engine.trainer import (
    TRAINABLE,
    DistillationTrainer,
    KeepBest,
    token_kl,
    trainable_parameters,
    trainer_arguments,
    unshare_from,
)

HOLDOUT_KL = "eval_holdout_kl"


class _LogEvaluations(TrainerCallback):
    def __init__(self, log: Callable[[str], None], steps: int, keep: KeepBest, started: float):
        self.log, self.steps, self.keep, self.started = log, steps, keep, started

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        kept = self.keep.kept
        if kept is not None and HOLDOUT_KL in (metrics or {}):
            self.log(f"distill step {state.global_step}/{self.steps}: held-out KL {metrics[HOLDOUT_KL]:.4f} "
                     f"(best {kept.best:.4f} at step {kept.step}), {time.perf_counter() - self.started:.0f}s")


def distill_to_source(student, teacher, windows: torch.Tensor, *, steps: int, lr: float = 1e-4, batch: int = 4,
                      holdout: int = 2, every: int = 10, trainable: str = "attention", seed: int = 0,
                      log: Callable[[str], None] | None = None) -> dict[str, float]:
    """AdamW (no weight decay, no clipping, constant ``lr``) on ``KL(teacher || student)`` over
    ``windows`` [N, T] (token ids); in place on ``student``.

    Batches of ``batch`` windows from the first ``N - holdout`` (shuffled, epoch after epoch);
    before the first step, every ``every`` steps and at the end the mean KL on the last
    ``holdout`` windows is measured, and the state with the lowest one is kept. ``teacher`` is
    only run under ``no_grad`` and never changed. Returns the held-out KL at the start and of the
    kept state, the kept step, and seconds.
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
    was_training = student.training
    keep = KeepBest(params, HOLDOUT_KL)
    try:
        for p in student.parameters():
            p.requires_grad_(id(p) in trained)
        with tempfile.TemporaryDirectory(prefix="hf_csa2_distill_") as tmp:
            args = trainer_arguments(tmp, steps=max(steps, 1), batch=min(batch, train.shape[0]), lr=lr,
                                     eval_every=every, log_every=every, seed=seed, progress=False)
            data = datasets.Dataset.from_dict({"input_ids": train.tolist()}).with_format("torch")
            trainer = DistillationTrainer(model=student, args=args, train_dataset=data, eval_dataset=data,
                                          data_collator=default_data_collator, teacher=teacher,
                                          held_out={"holdout": held}, callbacks=[keep])
            trainer.remove_callback(PrinterCallback)
            if log:
                trainer.add_callback(_LogEvaluations(log, steps, keep, started))
                log(f"distill: {len(params)} tensors ({sum(p.numel() for p in params):,} values) trainable")
            if steps == 0:
                trainer.evaluate()
            else:
                trainer.train()
                if steps % every:
                    trainer.evaluate()
    finally:
        if keep.kept is not None:
            keep.kept.restore()
        for p in student.parameters():
            p.requires_grad_(requires[id(p)])
            p.grad = None
        student.train(was_training)
    return {"distill_heldout_kl_before": keep.kept.start, "distill_heldout_kl_after": keep.kept.best,
            "distill_kept_step": keep.kept.step, "distill_seconds": round(time.perf_counter() - started, 1)}


__all__ = ["TRAINABLE", "distill_to_source", "token_kl", "trainable_parameters", "unshare_from"]
