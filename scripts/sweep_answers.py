"""Convert one source with several plan variants and judge each by its answers and on both corpora,
the source scored in the same run.

    python scripts/sweep_answers.py SOURCE --plan conversion/P.yaml [--variant NAME=S.F=V,S.F=V ...]
        [--context 512,1024] [--per-depth 20] [--ppl-window 512] [--ppl-windows 8] [--json OUT]

Each variant is the plan with ``--set``-style assignments (``as-is`` is always the first row).
Per variant and context: the answer check (facts planted far / near in held-out text of each corpus,
asked back; ``hf_csa2.metrics.answer_check``) and the held-out ppl ratio to the source on
``python-docs:heldout`` and ``fortunes:heldout``. Conversions are not saved.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import yaml

from hf_csa2.data.corpus import resolve_text
from hf_csa2.data.windows import token_windows
from hf_csa2.io.sources import load_source
from hf_csa2.metrics.answer_check import answer_check, make_probes
from hf_csa2.metrics.perplexity import mean_nll
from hf_csa2.surgery.pipeline import convert
from hf_csa2.surgery.plan import set_fields

CORPORA = ("python-docs:heldout", "fortunes:heldout")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source")
    parser.add_argument("--plan", required=True)
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=S.F=V,S.F=V")
    parser.add_argument("--context", default="512,1024")
    parser.add_argument("--per-depth", type=int, default=20)
    parser.add_argument("--ppl-window", type=int, default=512)
    parser.add_argument("--ppl-windows", type=int, default=8)
    parser.add_argument("--json")
    args = parser.parse_args()
    with open(args.plan) as f:
        base = yaml.safe_load(f)
    variants = [("as-is", [])]
    for v in args.variant:
        name, _, sets = v.partition("=")
        variants.append((name, [s for s in sets.split(",") if s]))
    src = load_source(args.source)
    tok = src.tokenizer
    probes = {}
    for corpus in CORPORA:
        for c in [int(x) for x in args.context.split(",")]:
            probes[corpus, c] = make_probes(tok, token_windows(tok, resolve_text(corpus), c, 8), args.per_depth)
    ppl_windows = {corpus: token_windows(tok, resolve_text(corpus), args.ppl_window, args.ppl_windows) for corpus in CORPORA}

    def judge(model) -> dict:
        row = {}
        for (corpus, c), p in probes.items():
            check = answer_check(model, p)
            row[f"{corpus.split(':')[0]}@{c}"] = {"far": check.far, "near": check.near, "nll": round(check.answer_nll, 3)}
        for corpus, w in ppl_windows.items():
            row[f"ppl {corpus.split(':')[0]}"] = mean_nll(model, w)["ppl"]
        return row

    ref = judge(src.model.eval())
    rows = [("source", ref, None)]
    print(f"source: {ref}", flush=True)
    for name, sets in variants:
        t0 = time.perf_counter()
        result = convert(args.source, set_fields(base, sets), log=lambda s: None)
        if getattr(result.model.config, "csa2_read_path", None):
            # Exact like "gather" (full logits, then the Top-K + window picked), much faster at these lengths.
            result.model.config.csa2_read_path = "scores"
        row = judge(result.model)
        for corpus in CORPORA:
            key = f"ppl {corpus.split(':')[0]}"
            row[key.replace("ppl", "ratio")] = row[key] / ref[key]
        stage = result.report[-1]
        row["calib_ppl"] = stage.calib_ppl
        row["kv_per_token"] = stage.kv_elements_per_token
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append((name, row, sets))
        print(f"{name} {sets}: {row}", flush=True)
        del result
    keys = [k for k in ref if "@" in k]
    print("\n| variant | " + " | ".join(f"{k} far/near" for k in keys) + " | ratio python-docs | ratio fortunes | KV/token |")
    print("|---|" + "---:|" * (len(keys) + 3))
    for name, row, _ in rows:
        cells = [f"{row[k]['far']}/{row[k]['near']}" for k in keys]
        ratios = [f"{row.get('ratio python-docs', 1.0):.3f}", f"{row.get('ratio fortunes', 1.0):.3f}"]
        print(f"| {name} | " + " | ".join(cells) + " | " + " | ".join(ratios) + f" | {row.get('kv_per_token', '')} |")
    print(f"(per depth {args.per_depth}; ppl {args.ppl_windows} x {args.ppl_window})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"name": n, "sets": s, **r} for n, r, s in rows], f, indent=2)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
