"""How well models do the training data's copy tasks (``data.tasks``: recall, next, fill, first, lookalike), teacher-forced.

    python scripts/copy_task_accuracy.py MODEL [MODEL ...] [--text python-docs:heldout] [--per-task 15]
        [--passage-chars 1600] [--generate TOKENS]

Builds chat exchanges from held-out text with :func:`hf_csa2.train.data.passages_to_chat` (the same
code that builds training data; held-out text, so none of them was trained on), renders each user turn
with the model's chat template and scores the passage's answer: the fraction of answer tokens where
the model's greedy prediction is the answer token (teacher-forced), and how many answers are right at
every token. All models must share one tokenizer; they see the same exchanges.

``--generate TOKENS`` scores greedy answers instead, written as ``data.answers: teacher`` writes them
(:func:`hf_csa2.train.teacher_answers.generate_answers`, at most TOKENS tokens): how many equal the
passage's sentence (whitespace aside), how many begin with its first five words, how many come out
empty, and the seconds per answer -- whether a model's own answers would be usable training targets.
"""

from __future__ import annotations

import argparse
import time

import torch

from hf_csa2.data.corpus import list_text_files, resolve_text
from hf_csa2.io.sources import load_source
from hf_csa2.train.data import PROMPTS, passages_to_chat
from hf_csa2.train.teacher_answers import generate_answers

TASKS = PROMPTS


def task_of(user_turn: str) -> str | None:
    request = user_turn.rpartition("\n\n")[2]
    for name, prompts in TASKS.items():
        if any(request.startswith(p.split("{")[0]) for p in prompts):
            return name
    return None


def exchanges(text: str, per_task: int, passage_chars: int) -> dict[str, list[list[dict]]]:
    """``per_task`` exchanges of each copy task, in file order."""
    picked = {name: [] for name in TASKS}
    for i, path in enumerate(list_text_files(resolve_text(text))):
        for ex in passages_to_chat(path.read_text(errors="replace"), passage_chars, i, tuple(TASKS)):
            name = task_of(ex[0]["content"])
            if name and len(picked[name]) < per_task:
                picked[name].append(ex)
        if all(len(v) >= per_task for v in picked.values()):
            break
    return picked


@torch.no_grad()
def score(model, tokenizer, exchange: list[dict]) -> tuple[int, int]:
    """(answer tokens predicted right, answer tokens)."""
    prompt = tokenizer.apply_chat_template([exchange[0]], tokenize=False, add_generation_prompt=True)
    p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    a_ids = tokenizer(exchange[1]["content"], add_special_tokens=False)["input_ids"]
    logits = model(torch.tensor([p_ids + a_ids])).logits[0, len(p_ids) - 1:-1]
    return int((logits.argmax(-1) == torch.tensor(a_ids)).sum()), len(a_ids)


def _words(text: str) -> list[str]:
    return text.split()


def generated(model, tokenizer, items: list[list[dict]], max_new_tokens: int) -> tuple[int, int, int, float]:
    """(answers equal to the passage's, answers that begin with its first five words, empty answers,
    seconds per answer) of greedy answers."""
    started = time.perf_counter()
    answers = generate_answers(model, tokenizer, [ex[:1] for ex in items], max_new_tokens)
    seconds = (time.perf_counter() - started) / max(len(items), 1)
    gold = [_words(ex[1]["content"]) for ex in items]
    equal = sum(_words(a) == g for a, g in zip(answers, gold))
    begins = sum(_words(a)[:5] == g[:5] for a, g in zip(answers, gold))
    return equal, begins, sum(not a for a in answers), seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--text", default="python-docs:heldout")
    ap.add_argument("--per-task", type=int, default=15)
    ap.add_argument("--passage-chars", type=int, default=1600)
    ap.add_argument("--generate", type=int, default=0, metavar="TOKENS",
                    help="score greedy answers of at most TOKENS tokens instead of teacher-forced tokens")
    args = ap.parse_args()
    loaded = [load_source(m) for m in args.models]
    tokenizer = loaded[0].tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise SystemExit(f"{args.models[0]}: the tokenizer has no chat template; the copy tasks are chat exchanges")
    picked = exchanges(args.text, args.per_task, args.passage_chars)
    if args.generate:
        print("| model | task | exchanges | greedy answer = passage's | begins with its first 5 words | empty | "
              "s / answer |\n|---|---|---:|---:|---:|---:|---:|")
    else:
        print("| model | task | exchanges | answer tokens right | answers right at every token |\n|---|---|---:|---:|---:|")
    for name, item in zip(args.models, loaded):
        model = item.model.eval()
        for task, items in picked.items():
            if args.generate:
                equal, begins, empty, seconds = generated(model, tokenizer, items, args.generate)
                n = len(items)
                print(f"| {name} | {task} | {n} | {equal}/{n} | {begins}/{n} | {empty}/{n} | {seconds:.1f} |", flush=True)
                continue
            scores = [score(model, tokenizer, ex) for ex in items]
            right, total = sum(s[0] for s in scores), sum(s[1] for s in scores)
            whole = sum(s[0] == s[1] for s in scores)
            print(f"| {name} | {task} | {len(items)} | {right / max(total, 1):.3f} | {whole}/{len(items)} |", flush=True)


if __name__ == "__main__":
    main()
