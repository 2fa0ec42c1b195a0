"""Every shipped preset against its source, on both held-out corpora and by its answers: one command
refreshes docs/presets.md (with ``--headers`` the measured block in each preset's header, with ``--readme``
the README's results table).

    python scripts/preset_table.py [--presets NAME,...] [--steps convert,ppl,answers,needle,ppl-long]
        [--answer-contexts 512,2048]
        [--work runs/preset_table] [--results docs/presets.json] [--out docs/presets.md] [--headers] [--readme]
        [--render-only] [--merge OTHER_RESULTS,...] [--long-contexts 4096,8192]

Per preset (``conversion/<NAME>.yaml``, source read from its ``hf-csa2 convert SOURCE`` line):
  convert   the plan converted and saved to WORK/NAME (its stage report: calib ppl, KV elements/token)
  ppl       held-out ppl on python-docs:heldout and fortunes:heldout, 4 x 2,048 tokens
  answers   the answer check (facts planted far / near, asked back, teacher-forced exact match),
            20 facts per depth, at 512 and 2,048 tokens on both corpora
  needle    the needle suite (six capabilities, depths 0 / 0.5 / 1, 7 per cell = 21 per capability
            and length) at 512 and 2,048 tokens; chat template for instruct sources, completion
            mode for base models
  ppl-long  held-out ppl on both corpora at 4,096 tokens and at the longest context the source
            supports, up to 8,192 tokens (8,192 tokens scored per column, like the 2K column:
            2 windows of 4,096, 1 of 8,192)
The source runs every measurement too; every measurement is deterministic (greedy, fixed windows),
so ratios to a source measured earlier by this script are the ratios of one run. Results are kept in
RESULTS (default docs/presets.json, committed: runs/ does not outlive a machine) with the commit that
made them: an interrupted refresh resumes where it stopped, ``--fresh`` starts again.
"""

from __future__ import annotations

import argparse
import gc
import functools
import json
import re
import subprocess
import time
from pathlib import Path

import torch

from hf_csa2.data.corpus import read_text, resolve_text
from hf_csa2.data.windows import token_windows
from hf_csa2.evals.needle import CATEGORIES, generate_samples, prompt_style
from hf_csa2.evals.needle_eval import generate_answers, score_records
from hf_csa2.io.sources import instruction_tuned, load_source
from hf_csa2.metrics.answer_check import answer_check, make_probes
from hf_csa2.metrics.perplexity import mean_nll
from hf_csa2.surgery.pipeline import convert

ROOT = Path(__file__).resolve().parent.parent
CORPORA = ("python-docs:heldout", "fortunes:heldout")
STEPS = ("convert", "ppl", "answers", "needle", "ppl-long")
ANSWER_CONTEXTS = (512, 2048)
NEEDLE_LENGTHS = (512, 2048)
NEEDLE_DEPTHS = (0.0, 0.5, 1.0)
NEEDLE_PER_CELL = 7
PPL_WINDOW, PPL_WINDOWS = 2048, 4
LONG_MAX, LONG_TOKENS = 8192, 8192
LONG_MIDDLE = 4096
BEGIN, END = "# >>> measured by scripts/preset_table.py", "# <<< measured"


def preset_source(path: Path) -> str:
    """The SOURCE of the ``hf-csa2 convert SOURCE --plan conversion/<name>.yaml`` line in a preset
    header (its own, or a sibling's that documents it)."""
    pattern = r"hf-csa2 convert (\S+) --plan conversion/" + re.escape(path.name)
    for text in [path.read_text()] + [p.read_text() for p in sorted(path.parent.glob("*.yaml"))]:
        if m := re.search(pattern, text):
            return m.group(1)
    raise SystemExit(f"{path}: no 'hf-csa2 convert SOURCE --plan {path}' line in any preset header")


@functools.lru_cache(maxsize=None)
def commit() -> str:
    """The code this process measures with: HEAD (+ if hf_csa2/ had changes) when first asked, i.e.
    when the modules were loaded; commits made while a long run goes on do not change what it runs."""
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "hf_csa2"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() + ("+" if dirty.stdout.strip() else "")


class Results:
    """The results file: {model: {measure: {value, commit, date}}}; written after every measurement."""

    def __init__(self, path: Path, fresh: bool):
        commit()  # pinned now, before any measurement
        self.path = path
        self.data = {} if fresh or not path.exists() else json.loads(path.read_text())

    def has(self, model: str, measure: str) -> bool:
        return measure in self.data.get(model, {})

    def get(self, model: str, measure: str, default=None):
        return self.data.get(model, {}).get(measure, default)

    def put(self, model: str, measure: str, value) -> None:
        self.data.setdefault(model, {})[measure] = {"value": value, "commit": commit(),
                                                   "date": time.strftime("%Y-%m-%d")}
        self._save()

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(self.path)

    def merge(self, other: Path) -> list[str]:
        """Take in the measurements of a parallel run (one started with ``--results`` on a copy of this
        file): every entry of ``other`` absent here or different from this file's is copied, so where both
        hold a measure, ``other``'s wins. Returns the "model: measure" names taken."""
        taken = []
        for model, measures in json.loads(other.read_text()).items():
            for m, entry in measures.items():
                if self.data.get(model, {}).get(m) != entry:
                    self.data.setdefault(model, {})[m] = entry
                    taken.append(f"{model}: {m}")
        self._save()
        return taken


def long_contexts(config, only=None) -> list[int]:
    """The contexts above the 2K table column that ``ppl-long`` measures: 4K and the longest the source
    supports up to 8K (one of them when they coincide, none above what the source supports); with
    ``only``, just those of them in it (``--long-contexts``: one column now, the other later)."""
    longest = min(LONG_MAX, int(getattr(config, "max_position_embeddings", LONG_MAX) or LONG_MAX))
    return sorted({n for n in (LONG_MIDDLE, longest) if PPL_WINDOW < n <= longest and (only is None or n in only)})


def measure(results: Results, key: str, model, tokenizer, source: str, steps: list[str], log,
            answer_contexts=ANSWER_CONTEXTS, long_only=None) -> None:
    if getattr(model.config, "csa2_read_path", None):
        model.config.csa2_read_path = "scores"  # exact like "gather", much faster at these lengths
    if "ppl" in steps:
        for corpus in CORPORA:
            m = f"ppl {corpus} {PPL_WINDOW}x{PPL_WINDOWS}"
            if not results.has(key, m):
                results.put(key, m, mean_nll(model, token_windows(tokenizer, resolve_text(corpus), PPL_WINDOW, PPL_WINDOWS))["ppl"])
                log(f"{key}: {m} = {results.get(key, m)['value']:.4f}")
    if "answers" in steps:
        for corpus in CORPORA:
            for c in answer_contexts:
                m = f"answers {corpus} {c}"
                if not results.has(key, m):
                    probes = make_probes(tokenizer, token_windows(tokenizer, resolve_text(corpus), c, 8), 20)
                    results.put(key, m, answer_check(model, probes).to_dict())
                    log(f"{key}: {m} = {results.get(key, m)['value']}")
    if "needle" in steps:
        text = read_text(resolve_text("python-docs:heldout"), max_chars=4_000_000)
        style = prompt_style(tokenizer, "auto", instruction_tuned(source))
        for length in NEEDLE_LENGTHS:
            m = f"needle {length}"
            if results.has(key, m):
                continue
            samples = generate_samples(tokenizer, text, lengths=(length,), depths=NEEDLE_DEPTHS,
                                       per_cell=NEEDLE_PER_CELL, seed=0, style=style)
            records = score_records(samples, generate_answers(model, tokenizer, samples))
            results.put(key, m, {"prompt_style": style, "records": [
                {k: r[k] for k in ("category", "depth", "correct", "output")} for r in records]})
            log(f"{key}: {m} = {sum(r['correct'] for r in records)}/{len(records)}")
    if "ppl-long" in steps:
        for n in long_contexts(model.config, long_only):
            for corpus in CORPORA:
                count = max(1, LONG_TOKENS // n)
                m = f"ppl {corpus} {n}x{count}"
                if not results.has(key, m):
                    windows = token_windows(tokenizer, resolve_text(corpus), n, count)
                    results.put(key, m, mean_nll(model, windows)["ppl"])
                    log(f"{key}: {m} = {results.get(key, m)['value']:.4f}")


# -- rendering --------------------------------------------------------------------------

def _ratio(results: Results, key: str, src: str, m: str) -> str:
    a, b = results.get(key, m), results.get(src, m)
    return f"{a['value'] / b['value']:.3f}" if a and b else "–"


def _answers(results: Results, key: str, m: str) -> str:
    v = results.get(key, m)
    return f"{v['value']['far']}/{v['value']['near']}" if v else "–"


def _needle(results: Results, key: str, length: int, category: str | None = None) -> str:
    v = results.get(key, f"needle {length}")
    if not v:
        return "–"
    recs = [r for r in v["value"]["records"] if category is None or r["category"] == category]
    return f"{sum(r['correct'] for r in recs)}/{len(recs)}"


def _ppl_keys(results: Results, src: str) -> tuple[list[str], list[str]]:
    short = [f"ppl {c} {PPL_WINDOW}x{PPL_WINDOWS}" for c in CORPORA]
    long_ = [m for c in CORPORA for m in results.data.get(src, {}) if m.startswith(f"ppl {c} ") and m not in short]
    # by context, then corpus: the columns read 4K both corpora, then 8K both corpora
    return short, sorted(long_, key=lambda m: (int(m.split()[2].split("x")[0]), CORPORA.index(m.split()[1])))


def render(results: Results, presets: dict[str, str]) -> str:
    by_source: dict[str, list[str]] = {}
    for name, source in presets.items():
        by_source.setdefault(source, []).append(name)
    lines = ["# Presets against their sources", "",
             "Generated by `python scripts/preset_table.py` (CPU fp32; the source measured by the same script,",
             "every measurement deterministic). `–`: not measured yet. Ratios are converted / source held-out",
             "perplexity; answers are far/near facts answered of 20 each (`hf_csa2.metrics.answer_check`);",
             f"needles are answered/asked over the six capabilities (depths {', '.join(map(str, NEEDLE_DEPTHS))},",
             f"{NEEDLE_PER_CELL} per cell, haystack python-docs:heldout). Commits: the `commit` of each entry in",
             "`docs/presets.json`; conversions in `runs/preset_table/<preset>`.", ""]
    for source, names in by_source.items():
        src = f"source:{source}"
        short, long_ = _ppl_keys(results, src)
        lines += [f"## {source}", ""]
        head = (["model", "KV/token at 8K"] + [f"ratio {m.split()[1].split(':')[0]} {m.split()[2]}" for m in short + long_]
                + [f"answers {c.split(':')[0]}@{n}" for c in CORPORA for n in ANSWER_CONTEXTS]
                + [f"needle {n}" for n in NEEDLE_LENGTHS])
        lines += ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
        for key, label in [(src, "source")] + [(n, f"`{n}`") for n in names]:
            kv = results.get(key, "kv_per_token_8k")
            row = [label, f"{kv['value']:,.0f}" if kv else "–"]
            row += ["1" if key == src and results.get(key, m) else _ratio(results, key, src, m) for m in short + long_]
            row += [_answers(results, key, f"answers {c} {n}") for c in CORPORA for n in ANSWER_CONTEXTS]
            row += [_needle(results, key, n) for n in NEEDLE_LENGTHS]
            lines.append("| " + " | ".join(row) + " |")
        lines += ["", f"Needles per capability ({source}; answered/asked at 512 | 2,048 tokens):", "",
                  "| model | " + " | ".join(CATEGORIES) + " |", "|---|" + "---:|" * len(CATEGORIES)]
        for key, label in [(src, "source")] + [(n, f"`{n}`") for n in names]:
            cells = [" / ".join(_needle(results, key, n, c) for n in NEEDLE_LENGTHS) for c in CATEGORIES]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        src_ppl = [f"{m.split()[1]} {m.split()[2]}: {results.get(src, m)['value']:.3f}" for m in short + long_
                   if results.get(src, m)]
        if src_ppl:
            lines += ["", "Source ppl: " + "; ".join(src_ppl) + "."]
        lines.append("")
    return "\n".join(lines)


README_BEGIN, README_END = "<!-- preset table: scripts/preset_table.py --readme -->", "<!-- end of preset table -->"


def _stage_answers(results: Results, key: str, first: bool = False) -> str:
    """The convert stage report's answer check (the source's is its first stage): far/near of N @ context."""
    v = results.get(key, "convert")
    if not v:
        return "–"
    a = v["value"]["answer_check"][0 if first else -1]
    return f"{a['far']}/{a['near']} of {a['per_depth']}, {a['context']:,} tokens"


def readme_table(results: Results, presets: dict[str, str]) -> list[str]:
    """The README's compact table: per source, its presets' cache, ppl ratios on both corpora at 2K and
    at 8K, and the answer check at 512 tokens (docs/presets.md has every column)."""
    sizes = [(PPL_WINDOW, PPL_WINDOWS), (LONG_MAX, max(1, LONG_TOKENS // LONG_MAX))]
    head = ["source / preset", "KV elements/token at 8K"] + [f"ppl ratio {c.split(':')[0]} {k} × {n:,}"
                                                               for n, k in sizes for c in CORPORA]
    head += [f"answers far/near of 20, {c.split(':')[0]} @{ANSWER_CONTEXTS[0]}" for c in CORPORA]
    head.append("stage-report answer check (calibration text and length)")
    lines = [README_BEGIN, "| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for source in dict.fromkeys(presets.values()):
        src = f"source:{source}"
        for key, label in [(src, f"**{source}** (source)")] + [(n, f"`{n}`") for n, s in presets.items() if s == source]:
            kv = results.get(key, "kv_per_token_8k")
            row = [label, f"{kv['value']:,.1f}" if kv else "–"]
            for m in [f"ppl {c} {n}x{k}" for n, k in sizes for c in CORPORA]:
                row.append(("1" if results.get(key, m) else "–") if key == src else _ratio(results, key, src, m))
            row += [_answers(results, key, f"answers {c} {ANSWER_CONTEXTS[0]}") for c in CORPORA]
            row.append(_stage_answers(results, key if key != src else next(
                (n for n, s in presets.items() if s == source and results.get(n, "convert")), ""), first=key == src))
            lines.append("| " + " | ".join(row) + " |")
    return lines + [README_END]


def write_between(path: Path, begin: str, end: str, block: list[str]) -> None:
    text = path.read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"{path}: no '{begin}' ... '{end}' markers to write the table between")
    head, rest = text.split(begin, 1)
    path.write_text(head + "\n".join(block) + rest.split(end, 1)[1])


def header_block(results: Results, name: str, source: str) -> list[str]:
    """The measured block of a preset header: what this script measured for it, next to the source, and
    which of its measurements are still missing (never a row of dashes)."""
    src = f"source:{source}"
    short, long_ = _ppl_keys(results, src)
    missing: list[str] = []

    def kept(label: str, value: str, source_value: str | None = None, what: str = "") -> str | None:
        if "–" in value:
            missing.append(what + label)
            return None
        return f"{label} {value}" + (f" (source {source_value})" if source_value is not None else "")

    ratios = [kept(f"{m.split()[1].split(':')[0]} {m.split()[2]}", _ratio(results, name, src, m), what="ppl ")
              for m in short + long_]
    answers = [kept(f"{c.split(':')[0]}@{n}", _answers(results, name, f"answers {c} {n}"),
                    _answers(results, src, f"answers {c} {n}"), what="answers ") for c in CORPORA for n in ANSWER_CONTEXTS]
    needles = [kept(f"needles {n}", _needle(results, name, n), _needle(results, src, n)) for n in NEEDLE_LENGTHS]
    kv = results.get(name, "kv_per_token_8k")
    stage = _stage_answers(results, name)
    commits = sorted({e["commit"] for e in results.data.get(name, {}).values()})
    worse = caveats(results, name, source)
    lines = [BEGIN + f" --presets {name} (code of {', '.join(commits)}; table: docs/presets.md)",
             f"#   KV elements/token at 8K: {kv['value']:,.1f}" if kv else None,
             f"#   stage-report answer check far/near: {stage} (source {_stage_answers(results, name, first=True)})"
             if stage != "–" else None,
             "#   held-out ppl ratio to the source: " + "; ".join(r for r in ratios if r) if any(ratios) else None,
             "#   answer check far/near of 20: " + "; ".join(a for a in answers if a) if any(answers) else None,
             "#   needles answered (6 capabilities x 21): " + "; ".join(n for n in needles if n) if any(needles) else None,
             "#   worse: " + "; ".join(worse) if worse else None,
             "#   not measured by it yet: " + ", ".join(missing) if missing else None,
             END]
    return [line for line in lines if line]


def _kept_fraction(results: Results, key: str, src: str, m: str) -> float | None:
    """Answers of the answer check kept, far + near, as a fraction of the source's."""
    a, b = results.get(key, m), results.get(src, m)
    if not a or not b or not b["value"]["far"] + b["value"]["near"]:
        return None
    return (a["value"]["far"] + a["value"]["near"]) / (b["value"]["far"] + b["value"]["near"])


def caveats(results: Results, name: str, source: str, margin: float = 0.005, answer_margin: float = 0.05) -> list[str]:
    """Where a preset is worse on the other corpus than on the calibration corpus's held-out part, or worse at
    the longer context than at the shorter one: the sentences a header must carry next to its figures."""
    src = f"source:{source}"
    home, other = CORPORA
    said: list[str] = []

    def ratio(m: str) -> float | None:
        a, b = results.get(name, m), results.get(src, m)
        return a["value"] / b["value"] if a and b else None

    short, long_ = _ppl_keys(results, src)
    for size in dict.fromkeys(m.split()[2] for m in short + long_):
        a, b = ratio(f"ppl {home} {size}"), ratio(f"ppl {other} {size}")
        if a is not None and b is not None and b > a + margin:
            said.append(f"ppl worse on the other domain at {size}: {other.split(':')[0]} {b:.3f} vs "
                        f"{home.split(':')[0]} {a:.3f}")
    for corpus in CORPORA:
        by_size = [(m.split()[2], ratio(m)) for m in short + long_ if m.split()[1] == corpus]
        by_size = [(size, r) for size, r in by_size if r is not None]
        if len(by_size) > 1 and by_size[-1][1] > by_size[0][1] + margin:
            said.append(f"ppl worse at length on {corpus.split(':')[0]}: {by_size[-1][1]:.3f} at {by_size[-1][0]} vs "
                        f"{by_size[0][1]:.3f} at {by_size[0][0]}")
    for n in ANSWER_CONTEXTS:
        a, b = (_kept_fraction(results, name, src, f"answers {c} {n}") for c in CORPORA)
        if a is not None and b is not None and b < a - answer_margin:
            said.append(f"answers worse on the other domain at {n:,} tokens: {b:.0%} of the source's kept vs {a:.0%}")
    for c in CORPORA:
        a, b = (_kept_fraction(results, name, src, f"answers {c} {n}") for n in ANSWER_CONTEXTS)
        if a is not None and b is not None and b < a - answer_margin:
            said.append(f"answers worse at length on {c.split(':')[0]}: {b:.0%} of the source's kept at "
                        f"{ANSWER_CONTEXTS[1]:,} tokens vs {a:.0%} at {ANSWER_CONTEXTS[0]:,}")
    return said


def write_header(path: Path, block: list[str]) -> None:
    lines = path.read_text().splitlines()
    if BEGIN.split(" (")[0] in "\n".join(lines):
        start = next(i for i, line in enumerate(lines) if line.startswith(BEGIN))
        end = next(i for i, line in enumerate(lines) if line.startswith(END))
        lines[start:end + 1] = block
    else:
        first = next(i for i, line in enumerate(lines) if not line.startswith("#"))
        lines[first:first] = block
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", help="comma-separated preset names (default: every conversion/*.yaml)")
    parser.add_argument("--steps", default=",".join(STEPS))
    parser.add_argument("--answer-contexts", default=",".join(map(str, ANSWER_CONTEXTS)),
                        help=f"answer-check contexts to measure now, of {ANSWER_CONTEXTS} (the table's columns)")
    parser.add_argument("--long-contexts", help=f"of the ppl-long contexts ({LONG_MIDDLE} and the longest the source "
                        f"supports up to {LONG_MAX}), measure only these now (comma-separated)")
    parser.add_argument("--work", default="runs/preset_table")
    parser.add_argument("--out", default="docs/presets.md")
    parser.add_argument("--results", default="docs/presets.json", help="the measurements (JSON), kept between refreshes")
    parser.add_argument("--headers", action="store_true", help="rewrite the measured block of each preset header")
    parser.add_argument("--readme", action="store_true", help="rewrite the compact table in README.md")
    parser.add_argument("--render-only", action="store_true")
    parser.add_argument("--fresh", action="store_true", help="forget earlier results")
    parser.add_argument("--merge", help="comma-separated results files of parallel runs to take into RESULTS first")
    args = parser.parse_args()
    steps = args.steps.split(",")
    answer_contexts = tuple(int(c) for c in args.answer_contexts.split(","))
    if bad := [c for c in answer_contexts if c not in ANSWER_CONTEXTS]:
        raise SystemExit(f"--answer-contexts {bad}; allowed: {', '.join(map(str, ANSWER_CONTEXTS))}")
    long_only = tuple(int(c) for c in args.long_contexts.split(",")) if args.long_contexts else None
    if long_only and (bad := [c for c in long_only if not PPL_WINDOW < c <= LONG_MAX]):
        raise SystemExit(f"--long-contexts {bad}; allowed: contexts above {PPL_WINDOW} up to {LONG_MAX}")
    if bad := [s for s in steps if s not in STEPS]:
        raise SystemExit(f"--steps {bad}; allowed: {', '.join(STEPS)}")
    paths = sorted((ROOT / "conversion").glob("*.yaml"))
    if args.presets:
        wanted = args.presets.split(",")
        paths = [p for p in paths if p.stem in wanted]
        if missing := set(wanted) - {p.stem for p in paths}:
            raise SystemExit(f"--presets: no conversion/{sorted(missing)[0]}.yaml")
    presets = {p.stem: preset_source(p) for p in paths}
    work = Path(args.work)
    results = Results(ROOT / args.results, args.fresh)
    for other in args.merge.split(",") if args.merge else []:
        print(f"merged from {other}:", ", ".join(results.merge(Path(other))) or "nothing new", flush=True)

    def log(msg: str) -> None:
        print(time.strftime("%H:%M:%S"), msg, flush=True)

    if not args.render_only:
        for source in dict.fromkeys(presets.values()):
            loaded = load_source(source)
            measure(results, f"source:{source}", loaded.model, loaded.tokenizer, source, steps, log, answer_contexts, long_only)
            del loaded
            gc.collect()
            for name in [n for n, s in presets.items() if s == source]:
                out = work / name
                if "convert" in steps and not (out / "conversion_report.json").exists():
                    t0 = time.perf_counter()
                    result = convert(source, ROOT / "conversion" / f"{name}.yaml", out_dir=out, overwrite=True,
                                     log=lambda s: None)
                    stages = result.report
                    results.put(name, "convert", {"seconds": round(time.perf_counter() - t0),
                                                  "calib_ppl": [s.calib_ppl for s in stages],
                                                  "answer_check": [s.answer_check for s in stages]})
                    results.put(name, "kv_per_token_8k", stages[-1].kv_elements_per_token)
                    results.put(f"source:{source}", "kv_per_token_8k", stages[0].kv_elements_per_token)
                    log(f"{name}: converted in {time.perf_counter() - t0:.0f} s")
                    del result
                    gc.collect()
                if not (out / "conversion_report.json").exists():
                    continue
                loaded = load_source(out)
                measure(results, name, loaded.model, loaded.tokenizer, source, steps, log, answer_contexts, long_only)
                del loaded
                gc.collect()
                (ROOT / args.out).write_text(render(results, presets))
    (ROOT / args.out).write_text(render(results, presets))
    if args.readme:
        write_between(ROOT / "README.md", README_BEGIN, README_END, readme_table(results, presets))
    if args.headers:
        for name, source in presets.items():
            if name in results.data:  # a block of dashes would only hide the header's own figures
                write_header(ROOT / "conversion" / f"{name}.yaml", header_block(results, name, source))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
