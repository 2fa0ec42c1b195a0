"""Seconds per training micro-batch of a recipe, for variants of its loss and LoRA settings, in one run.

    python scripts/bench_train_step.py RECIPE.yaml --student runs/<converted> [--blocks 1] [--repeats 2]
        [--variant ""] [--variant "loss.positions=128"] [--variant "loss.positions=128 peft.layers=[5,6,...]"]

Each ``--variant`` is a space-separated list of ``--set`` overrides applied on top of the recipe (``""``: the
recipe as it is). The student is an already converted folder (the recipe's ``plan`` is not run). For each variant:
the trainer the recipe builds (teacher, LoRA, the surgery parameters in full) runs ``--repeats`` forward+backward
passes (``Trainer.training_step``) on the same ``--blocks`` blocks of ``data.seq_len`` random tokens; prints the
median seconds and the trainable values. Variants alternate within each repeat so a noisy machine hits them alike.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import datasets
import torch

from hf_csa2.engine.trainer import DistillationTrainer
from hf_csa2.io.sources import load_source, resolve_source
from hf_csa2.train.recipe import load_recipe
from hf_csa2.train.run import _recorded_source
from hf_csa2.train.trainer import prepare_student, training_arguments


def build(recipe_path: str, student: str, sets: list[str], teacher, out: str):
    recipe = load_recipe(recipe_path, [f"student={student}", "plan=null", "plan_set=[]", *sets])
    model, _ = prepare_student(load_source(student).model, teacher, recipe)
    trainer = DistillationTrainer(
        model=model, args=training_arguments(recipe, out), teacher=teacher, held_out={},
        eval_dataset=datasets.Dataset.from_dict({"input_ids": [[1, 2]]}), loss=recipe.loss.kind,
        positions=recipe.loss.positions, evaluate_at_start=False)
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's own loop, which this bench does not run
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return recipe, trainer, trainable


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipe")
    ap.add_argument("--student", required=True, help="a converted folder")
    ap.add_argument("--variant", action="append", default=None, help="space-separated --set overrides")
    ap.add_argument("--blocks", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    variants = args.variant or [""]
    teacher = load_source(_recorded_source(resolve_source(args.student)[1])).model  # the recipe's default teacher
    runs = []
    with tempfile.TemporaryDirectory() as out:
        for v in variants:
            recipe, trainer, trainable = build(args.recipe, args.student, v.split(), teacher, out)
            runs.append((v, recipe, trainer, trainable, []))
        seq = runs[0][1].data.seq_len
        torch.manual_seed(0)
        ids = torch.randint(10, 5000, (args.blocks, seq))
        for _ in range(args.repeats):
            for v, recipe, trainer, _, times in runs:
                trainer.model.train()
                t = time.perf_counter()
                trainer.training_step(trainer.model, {"input_ids": ids})
                times.append(time.perf_counter() - t)
                trainer.model.zero_grad(set_to_none=True)
    print(f"| variant | seconds per micro-batch of {args.blocks} x {seq} (median of {args.repeats}) | trainable values |")
    print("|---|---:|---:|")
    for v, _, _, trainable, times in runs:
        print(f"| `{v or 'as recipe'}` | {statistics.median(times):.1f} | {trainable:,} |")


if __name__ == "__main__":
    main()
