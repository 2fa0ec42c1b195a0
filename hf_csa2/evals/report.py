"""One markdown report comparing an original model with its conversions: quality (held-out
perplexity), memory capabilities (needle tasks, with heatmaps) and cost (interleaved bench).

Every number is measured in the run that writes the report, on the same windows, samples and
prompts for every model; the report records the settings so it can be reproduced.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..data.corpus import read_text, resolve_text
from .bench import bench, format_bench_table
from .needle import CATEGORIES, generate_samples
from .needle_eval import generate_answers, score_records, write_reports
from .ppl import compare_ppl, format_ppl_table


@dataclass
class ReportSettings:
    text: str = "python-docs:heldout"
    window: int = 512
    max_windows: int = 8
    needle_lengths: list[int] = field(default_factory=lambda: [1024, 2048])
    needle_depths: list[float] = field(default_factory=lambda: [0.0, 0.5, 1.0])
    per_cell: int = 2
    categories: list[str] = field(default_factory=lambda: list(CATEGORIES))
    seed: int = 0
    chat_template: bool = True
    prompt_style: str = "chat"  # needle prompts: chat or completion (hf_csa2.evals.needle.prompt_style)
    bench_lengths: list[int] = field(default_factory=lambda: [1024, 2048])
    bench_repeats: int = 1
    bench_new_tokens: int = 16


def write_report(models: list[tuple[str, object, object]], out_dir: str | Path, settings: ReportSettings | None = None,
                 command: str | None = None, log=None) -> Path:
    """Measure ``models`` ((name, model, tokenizer); the first is the reference) and write
    ``report.md`` plus the raw JSON files and heatmaps into ``out_dir``."""
    s = settings or ReportSettings()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    say = log or (lambda msg: None)

    say("perplexity")
    ppl = compare_ppl([(n, m, t) for n, m, t in models], s.text, window=s.window, max_windows=s.max_windows)
    (out / "ppl.json").write_text(json.dumps(list(ppl), indent=1))

    say("needle")
    tokenizer = models[0][2]
    samples = generate_samples(tokenizer, read_text(resolve_text(s.text), max_chars=4_000_000),
                               categories=s.categories, lengths=s.needle_lengths, depths=s.needle_depths,
                               per_cell=s.per_cell, seed=s.seed, style=s.prompt_style)
    needle_results = {
        name: score_records(samples, generate_answers(model, tok, samples, chat_template=s.chat_template))
        for name, model, tok in models
    }
    needle = write_reports(needle_results, out / "needle", settings=vars(s))

    say("bench")
    rows = bench([(n, m) for n, m, _ in models], s.bench_lengths, new_tokens=s.bench_new_tokens,
                 repeats=s.bench_repeats, log=say)
    (out / "bench.json").write_text(json.dumps({"rows": rows}, indent=1))

    heatmaps = "\n".join(f"![{Path(p).stem}](needle/{Path(p).name})" for p in needle["heatmaps"])
    lines = [
        f"# hf-csa2 report: {', '.join(n for n, _, _ in models)}",
        "",
        f"Reproduce: `{command}`" if command else "",
        "",
        f"Settings: `{json.dumps(vars(s))}`",
        "",
        f"## Held-out perplexity ({s.max_windows} windows x {s.window} tokens of `{s.text}`)",
        "",
        format_ppl_table(ppl),
        "",
        f"## Memory capabilities (needle tasks, {len(samples)} samples per model, greedy, contains-match)",
        "",
        needle["table"],
        "",
        heatmaps,
        "",
        f"## Cost (interleaved, medians of {s.bench_repeats}, {s.bench_new_tokens} decode steps, batch 1)",
        "",
        format_bench_table(rows),
        "",
    ]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


__all__ = ["ReportSettings", "write_report"]
