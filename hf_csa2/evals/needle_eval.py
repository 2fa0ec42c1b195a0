"""Run needle samples through models and report per-capability accuracy.

Outputs (see :func:`write_reports`): ``needle.json`` with one record per sample and model
(length, depth, category, answer, output, correct), ``needle.md`` with a capability x length
table (one column per model plus ratios to the first), and ``heatmap_<model>_<category>.png``
(depth x length accuracy).
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import InputError
from ..metrics.intervals import wilson_interval
from .needle import CATEGORIES, NeedleSample, score_output


def _templated(tokenizer, sample: NeedleSample, chat_template: bool) -> bool:
    return sample.style == "chat" and chat_template and bool(getattr(tokenizer, "chat_template", None))


def build_prompt(tokenizer, sample: NeedleSample, chat_template: bool = True) -> str:
    """The text fed to the model: the chat template around a chat-style context when the
    tokenizer has one and ``chat_template`` is on, else the raw context (always for
    completion-style samples: the answer is their continuation)."""
    if _templated(tokenizer, sample, chat_template):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": sample.context}], tokenize=False, add_generation_prompt=True
        )
    return sample.context


@torch.no_grad()
def generate_answers(model, tokenizer, samples: list[NeedleSample], *, chat_template: bool = True,
                     max_new_tokens: int = 32, done: dict[str, str] | None = None,
                     on_output: Callable[[NeedleSample, str], None] | None = None) -> list[str]:
    """Greedy outputs, one sample at a time (no padding effects), decoded without specials.

    ``model`` is a causal LM, or any callable ``prompt -> output text`` (scripted baselines).
    ``done`` maps sample ids to outputs already generated (a resumed run skips them);
    ``on_output(sample, output)`` is called after each new generation (e.g. to journal it).
    """
    done = done or {}
    if isinstance(model, torch.nn.Module):
        model.eval()
    outputs = []
    for sample in samples:
        if sample.id in done:
            outputs.append(done[sample.id])
            continue
        prompt = build_prompt(tokenizer, sample, chat_template)
        if isinstance(model, torch.nn.Module):
            enc = tokenizer(prompt, return_tensors="pt", add_special_tokens=not _templated(tokenizer, sample, chat_template))
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
            out = tokenizer.decode(gen[0, enc.input_ids.shape[1]:], skip_special_tokens=True)
        else:
            out = model(prompt)
        outputs.append(out)
        if on_output is not None:
            on_output(sample, out)
    return outputs


class OutputJournal:
    """Append-only JSONL of generated outputs, so a long needle run survives interruption.

    The first line holds the run settings; a later run with the same settings resumes (each
    model skips the samples it already answered), with other settings it is refused.
    """

    def __init__(self, path: str | Path, settings: dict):
        self.path = Path(path)
        self.done: dict[str, dict[str, str]] = {}
        if self.path.exists():
            lines = self.path.read_text().splitlines()
            head = json.loads(lines[0]) if lines else {}
            if head.get("settings") != settings:
                raise InputError(f"{self.path} holds a needle run with other settings ({head.get('settings')}); "
                                 f"delete it or pass another --out to start afresh")
            for line in lines[1:]:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:  # a line cut by the interruption
                    continue
                self.done.setdefault(rec["model"], {})[rec["id"]] = rec["output"]
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps({"settings": settings}) + "\n")

    def writer(self, model_name: str) -> Callable[[NeedleSample, str], None]:
        def write(sample: NeedleSample, output: str) -> None:
            with self.path.open("a") as f:
                f.write(json.dumps({"model": model_name, "id": sample.id, "output": output}) + "\n")

        return write


def score_records(samples: list[NeedleSample], outputs: list[str]) -> list[dict]:
    """Per-sample records: id, category, length, target_length, depth, answer, output, correct."""
    return [
        {"id": s.id, "category": s.category, "target_length": s.target_length, "length": s.length,
         "depth": s.depth, "answer": s.answer, "wrong": s.wrong, "output": out, "correct": score_output(s, out)}
        for s, out in zip(samples, outputs)
    ]


def accuracy_table(records: list[dict]) -> dict[tuple[str, int], float]:
    """(category, target_length) -> accuracy."""
    cells: dict[tuple[str, int], list[bool]] = defaultdict(list)
    for r in records:
        cells[(r["category"], r["target_length"])].append(r["correct"])
    return {k: sum(v) / len(v) for k, v in cells.items()}


def _answered(records: list[dict]) -> dict[tuple[str, int], tuple[int, int]]:
    """(category, target_length) -> (answered, asked)."""
    cells: dict[tuple[str, int], list[bool]] = defaultdict(list)
    for r in records:
        cells[(r["category"], r["target_length"])].append(r["correct"])
    return {k: (sum(v), len(v)) for k, v in cells.items()}


def format_accuracy(answered: int, asked: int) -> str:
    """``0.62 [0.41, 0.79]``: the accuracy and its 95 % Wilson interval."""
    low, high = wilson_interval(answered, asked)
    return f"{answered / asked:.2f} [{low:.2f}, {high:.2f}]"


def format_markdown(results: dict[str, list[dict]]) -> str:
    """One table: rows = capability x length, a column per model (accuracy and its 95 % Wilson
    interval), ratios to the first model."""
    names = list(results)
    tables = {n: accuracy_table(r) for n, r in results.items()}
    answered = {n: _answered(r) for n, r in results.items()}
    keys = sorted({k for t in tables.values() for k in t}, key=lambda k: (CATEGORIES.index(k[0]), k[1]))
    counts = defaultdict(int)
    for r in results[names[0]]:
        counts[(r["category"], r["target_length"])] += 1
    header = ["capability", "length", "n"] + names + [f"{n} / {names[0]}" for n in names[1:]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for cat, length in keys:
        accs = [tables[n].get((cat, length), math.nan) for n in names]
        base = accs[0]
        ratios = [f"{a / base:.2f}" if base else "n/a" for a in accs[1:]]
        cells = [format_accuracy(*answered[n][(cat, length)]) if (cat, length) in answered[n] else "n/a" for n in names]
        lines.append("| " + " | ".join([cat, str(length), str(counts[(cat, length)])] + cells + ratios) + " |")
    return "\n".join(lines)


def format_depth_markdown(results: dict[str, list[dict]]) -> str:
    """One table of every capability pooled: rows = length x depth, a column per model with
    answered / asked, so "lost only the far facts" and "lost everything" read differently."""
    names = list(results)
    cells = {n: defaultdict(list) for n in names}
    for n, records in results.items():
        for r in records:
            cells[n][(r["target_length"], r["depth"])].append(r["correct"])
    keys = sorted({k for c in cells.values() for k in c})
    lines = ["| length | depth | " + " | ".join(names) + " |", "|" + "---|" * (2 + len(names))]
    for length, depth in keys:
        row = [f"{sum(cells[n][(length, depth)])}/{len(cells[n][(length, depth)])}" for n in names]
        lines.append(f"| {length} | {depth:.0%} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "model"


def write_heatmaps(name: str, records: list[dict], out_dir: Path) -> list[Path]:
    """One depth x length accuracy heatmap PNG per capability."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for cat in CATEGORIES:
        recs = [r for r in records if r["category"] == cat]
        if not recs:
            continue
        lengths = sorted({r["target_length"] for r in recs})
        depths = sorted({r["depth"] for r in recs})
        grid = [[math.nan] * len(lengths) for _ in depths]
        for i, d in enumerate(depths):
            for j, n in enumerate(lengths):
                cell = [r["correct"] for r in recs if r["depth"] == d and r["target_length"] == n]
                if cell:
                    grid[i][j] = sum(cell) / len(cell)
        fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(lengths), 1.0 + 0.5 * len(depths)))
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("depth")
        ax.set_title(f"{name}: {cat}", fontsize=9)
        for i in range(len(depths)):
            for j in range(len(lengths)):
                if not math.isnan(grid[i][j]):
                    ax.text(j, i, f"{grid[i][j]:.2f}", ha="center", va="center",
                            color="white" if grid[i][j] < 0.5 else "black", fontsize=8)
        fig.colorbar(im, ax=ax, fraction=0.05)
        fig.tight_layout()
        path = out_dir / f"heatmap_{_slug(name)}_{cat}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def write_reports(results: dict[str, list[dict]], out_dir: str | Path, settings: dict | None = None) -> dict:
    """Write needle.json, needle.md and heatmaps; return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "needle.json").write_text(json.dumps({"settings": settings or {}, "results": results}, indent=1))
    md = format_markdown(results)
    by_depth = format_depth_markdown(results)
    (out / "needle.md").write_text(f"{md}\n\nBy length and depth (all capabilities):\n\n{by_depth}\n")
    heatmaps = [str(p) for name, recs in results.items() for p in write_heatmaps(name, recs, out)]
    return {"json": str(out / "needle.json"), "markdown": str(out / "needle.md"), "heatmaps": heatmaps,
            "table": f"{md}\n\n{by_depth}"}


__all__ = ["accuracy_table", "build_prompt", "format_depth_markdown", "format_markdown", "generate_answers", "score_records", "write_heatmaps",
           "write_reports"]
