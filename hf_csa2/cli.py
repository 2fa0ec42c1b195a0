"""The ``hf-csa2`` command line: one tool, subcommands.

    hf-csa2 convert SOURCE (--plan YAML | --to gqa --kv-heads N [--init ...]) [--sinks] --out DIR
    hf-csa2 distill SOURCE CONVERTED --out DIR [--steps N] [--lr X] [--trainable attention|all]
    hf-csa2 eval ppl MODEL [MODEL ...] --text FILE_OR_DIR [--window 512] [--max-windows N] [--json OUT]
    hf-csa2 eval needle MODEL [MODEL ...] --out DIR [--lengths 1024,2048,4096] [--per-cell 4]
    hf-csa2 eval lm MODEL --tasks T1,T2 [--metadata JSON] [--include_path DIR]
    hf-csa2 eval report ORIGINAL CONVERTED [...] --out DIR
    hf-csa2 bench MODEL [MODEL ...] [--lengths 2048,4096,8192] [--new-tokens 16] [--repeats 3] [--batch 1]
    hf-csa2 inspect MODEL [--json]
    hf-csa2 plan SOURCE --kv-budget X --plan BASE_YAML --out PLAN_YAML [--context 8192] [--swa-pass]
    hf-csa2 export DIR --format deepseek_v3 --out OUT [--overwrite]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from .surgery.plan import DISTILL_TRAINABLE, GQA_INITS, PlanError

EXIT_USAGE = 2


def _convert(args) -> int:
    from .surgery.pipeline import convert, format_report_table
    from .surgery.plan import CalibrationPlan, ConversionPlan, GqaPlan, SinksPlan

    if args.plan and (args.to or args.kv_heads is not None):
        raise PlanError("give either --plan or --to/--kv-heads, not both")
    if args.plan:
        plan = ConversionPlan.from_yaml(args.plan)
        if args.sinks and plan.sinks is None:
            plan.sinks = SinksPlan()
    else:
        if args.to is None and not args.sinks:
            raise PlanError("nothing to do: give --plan YAML, --to gqa --kv-heads N, or --sinks")
        if args.to == "gqa" and args.kv_heads is None:
            raise PlanError("--to gqa needs --kv-heads N (N must divide the number of query heads)")
        gqa = GqaPlan(num_key_value_heads=args.kv_heads, init=args.init) if args.to == "gqa" else None
        plan = ConversionPlan(gqa=gqa, sinks=SinksPlan() if args.sinks else None)
    if args.calib_text or args.calib_tokens:
        cal = plan.calibration
        plan.calibration = CalibrationPlan(
            text=args.calib_text or cal.text, num_tokens=args.calib_tokens or cal.num_tokens,
            seq_len=cal.seq_len, eval_windows=cal.eval_windows,
        )
    plan.validate()
    result = convert(args.source, plan, out_dir=args.out, overwrite=args.overwrite, log=_log)
    print(format_report_table(result.report))
    return 0


def _distill(args) -> int:
    from .surgery.pipeline import distill_checkpoint, format_report_table

    fields = ("steps", "lr", "batch", "num_tokens", "holdout", "every", "trainable")
    overrides = {f: getattr(args, f) for f in fields if getattr(args, f) is not None}
    result = distill_checkpoint(args.source, args.converted, out_dir=args.out, overrides=overrides,
                                overwrite=args.overwrite, log=_log)
    print(format_report_table(result.report))
    return 0


def _eval_ppl(args) -> int:
    from .evals.ppl import compare_ppl, format_ppl_table, write_ppl_json
    from .surgery.sources import load_source

    entries = [(name, (lambda n=name: load_source(n, check_supported=False))) for name in args.models]
    try:
        results = compare_ppl(entries, args.text, window=args.window, max_windows=args.max_windows, batch_size=args.batch_size)
    except ValueError as err:  # e.g. models with different tokenizers, text shorter than one window
        raise PlanError(str(err)) from err
    print(format_ppl_table(results))
    if args.json:
        write_ppl_json(results, args.json)
    return 0


def _eval_needle(args) -> int:
    import gc

    from .data.corpus import read_text, resolve_text
    from .evals.needle import CATEGORIES, generate_samples, write_jsonl
    from .evals.needle_eval import OutputJournal, generate_answers, score_records, write_reports
    from .surgery.sources import load_source

    categories = args.categories.split(",") if args.categories else list(CATEGORIES)
    bad = [c for c in categories if c not in CATEGORIES]
    if bad:
        raise PlanError(f"--categories {bad}; allowed: {', '.join(CATEGORIES)}")
    lengths = _int_list(args.lengths, "--lengths")
    depths = _float_list(args.depths, "--depths")
    if any(not 0.0 <= d <= 1.0 for d in depths):
        raise PlanError(f"--depths {depths}; allowed: numbers in [0, 1]")
    text = read_text(resolve_text(args.text), max_chars=4_000_000)
    settings = {"models": list(args.models), "categories": categories, "lengths": lengths, "depths": depths,
                "per_cell": args.per_cell, "seed": args.seed, "text": args.text,
                "chat_template": not args.no_chat_template, "max_new_tokens": args.max_new_tokens}
    try:
        journal = OutputJournal(Path(args.out) / "needle.partial.jsonl", settings)
    except ValueError as err:
        raise PlanError(str(err)) from err
    results, samples = {}, None
    for name in args.models:
        loaded = load_source(name, check_supported=False)
        if samples is None:  # one sample set, made with the first model's tokenizer, for every model
            try:
                samples = generate_samples(loaded.tokenizer, text, categories=categories, lengths=lengths,
                                           depths=depths, per_cell=args.per_cell, seed=args.seed)
            except ValueError as err:
                raise PlanError(str(err)) from err
            if args.export_jsonl:
                write_jsonl(samples, args.export_jsonl)
            _log(f"{len(samples)} samples: {len(categories)} capabilities x {len(lengths)} lengths x "
                 f"{len(depths)} depths x {args.per_cell}")
        done = journal.done.get(name, {})
        if done:
            _log(f"{name}: resuming, {len(done)} of {len(samples)} samples already answered ({journal.path})")
        outputs = generate_answers(loaded.model, loaded.tokenizer, samples, chat_template=not args.no_chat_template,
                                   max_new_tokens=args.max_new_tokens, done=done, on_output=journal.writer(name))
        results[name] = score_records(samples, outputs)
        del loaded
        gc.collect()
    paths = write_reports(results, args.out, settings)
    print(paths["table"])
    _log(f"wrote {paths['json']}, {paths['markdown']} and {len(paths['heatmaps'])} heatmaps")
    return 0


def _eval_lm(args) -> int:
    from .evals.lm_eval_glue import run_lm_eval, summarise, write_results
    from .surgery.sources import load_source

    try:
        metadata = json.loads(args.metadata) if args.metadata else None
    except json.JSONDecodeError as err:
        raise PlanError(f"--metadata is not valid JSON: {err}") from None
    loaded = load_source(args.model, check_supported=False)
    results = run_lm_eval(
        loaded.model, loaded.tokenizer, args.tasks.split(","), include_paths=args.include_path, metadata=metadata,
        limit=args.limit, batch_size=args.batch_size, apply_chat_template=args.apply_chat_template,
    )
    print(summarise(results))
    if args.json:
        write_results(results, args.json)
    return 0


def _eval_report(args) -> int:
    from .evals.report import ReportSettings, write_report
    from .surgery.sources import load_source

    settings = ReportSettings(
        text=args.text, window=args.window, max_windows=args.max_windows,
        needle_lengths=_int_list(args.needle_lengths, "--needle-lengths"),
        needle_depths=_float_list(args.needle_depths, "--needle-depths"), per_cell=args.per_cell, seed=args.seed,
        chat_template=not args.no_chat_template, bench_lengths=_int_list(args.bench_lengths, "--bench-lengths"),
        bench_repeats=args.repeats,
    )
    loaded = [load_source(name, check_supported=False) for name in args.models]
    models = [(name, src.model, src.tokenizer) for name, src in zip(args.models, loaded)]
    try:
        path = write_report(models, args.out, settings, command="hf-csa2 " + " ".join(args.argv), log=_log)
    except ValueError as err:
        raise PlanError(str(err)) from err
    print(path.read_text())
    return 0


def _bench(args) -> int:
    from .evals.bench import bench, format_bench_table
    from .surgery.sources import load_source

    lengths = _int_list(args.lengths, "--lengths")
    models = [(name, load_source(name, check_supported=False).model) for name in args.models]  # all resident: measurements interleave
    try:
        rows = bench(models, lengths, new_tokens=args.new_tokens, repeats=args.repeats, batch=args.batch, log=_log)
    except ValueError as err:
        raise PlanError(str(err)) from err
    print(format_bench_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))
    return 0


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PlanError(f"{flag} {text!r}; allowed: comma-separated positive integers, e.g. 1024,2048") from None
    if not values or any(v < 1 for v in values):
        raise PlanError(f"{flag} {text!r}; allowed: comma-separated positive integers, e.g. 1024,2048")
    return values


def _float_list(text: str, flag: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PlanError(f"{flag} {text!r}; allowed: comma-separated numbers, e.g. 0,0.5,1") from None


def _inspect(args) -> int:
    from .evals.kv_cache import (
        QK_NORM_MODEL_TYPES,
        config_kv_elements_at_context,
        config_kv_elements_per_token,
        layer_attention_specs,
        layer_kv_elements_per_token,
        measure_kv_elements_at_context,
        measure_kv_elements_per_token,
        measurement_length,
    )
    from .model.configuration_hf_csa2 import attention_head_dim
    from .surgery.sources import load_source

    loaded = load_source(args.model, check_supported=False)
    cfg = loaded.model.config
    layers = layer_attention_specs(cfg)
    head_dim = attention_head_dim(cfg)
    qk_norm = getattr(cfg, "base_model_type", cfg.model_type) in QK_NORM_MODEL_TYPES
    for spec in layers:
        spec["kv_elements_per_token"] = layer_kv_elements_per_token(spec, head_dim, qk_norm)
    info = {
        "model": args.model,
        "architecture": type(loaded.model).__name__,
        "base_model_type": getattr(cfg, "base_model_type", cfg.model_type),
        "num_attention_heads": cfg.num_attention_heads,
        "head_dim": head_dim,
        "layers": layers,
        "kv_elements_per_token_config": config_kv_elements_per_token(cfg),
        "kv_elements_per_token_measured": measure_kv_elements_per_token(loaded.model, num_tokens=args.tokens),
        "measured_with_tokens": measurement_length(cfg, args.tokens),
    }
    if args.context:
        # Windowed layers keep only their last tokens: per-token cost depends on the context.
        info["context"] = args.context
        info["kv_elements_per_token_at_context_config"] = config_kv_elements_at_context(cfg, args.context) / args.context
        info["kv_elements_per_token_at_context_measured"] = measure_kv_elements_at_context(loaded.model, args.context)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{info['model']}: {info['architecture']} ({info['base_model_type']}), {cfg.num_attention_heads} query heads, head_dim {head_dim}")
    print("| layer | kind | kv heads | latent | rope key | sinks | window | KV elements/token |")
    print("|---:|---|---:|---:|---:|---|---:|---:|")
    for i, s in enumerate(layers):
        latent = s.get("kv_lora_rank", "-")
        rope = sum(2 * len(p) for p in s["rope_pairs"]) if "rope_pairs" in s else "-"
        kind = s["kind"] if s["kind"] != "csa2" else f"csa2 {s['mode']}" + (f" <- {s['source']}" if "source" in s else "")
        if "top_k" in s:
            kind += f" (top-{s['top_k']}, window {s['read_window']})"
        print(f"| {i} | {kind} | {s['num_key_value_heads']} | {latent} | {rope} | {s.get('sinks', False)} | "
              f"{s['window'] or '-'}{' + first ' + str(s['sink_tokens']) if s.get('sink_tokens') else ''} | "
              f"{s['kv_elements_per_token']} |")
    print(f"KV elements per token: config {info['kv_elements_per_token_config']}, "
          f"measured from the live cache after a {info['measured_with_tokens']}-token prefill {info['kv_elements_per_token_measured']:.0f}")
    if args.context:
        print(f"KV elements per token at a {args.context}-token context: config "
              f"{info['kv_elements_per_token_at_context_config']:.1f}, live cache {info['kv_elements_per_token_at_context_measured']:.1f}")
    return 0


def _export(args) -> int:
    from .export.deepseek_v3 import export_checkpoint

    out = export_checkpoint(args.model, args.out, args.format, overwrite=args.overwrite)
    _log(f"saved {out} ({args.format}; loads with AutoModelForCausalLM, no remote code)")
    return 0


def _plan(args) -> int:
    import yaml

    from .evals.kv_cache import config_kv_elements_at_context
    from .surgery.pipeline import csa2_arguments, peek_config, prepare_source, run_stages
    from .surgery.plan import ConversionPlan
    from .surgery.plan_search import SEARCH_OTHER_MODES, format_curve, parse_kv_budget, search_plan
    from .surgery.sources import resolve_source

    out = Path(args.out)
    if out.exists() and not args.overwrite:
        raise PlanError(f"--out {str(out)!r} exists; pass --overwrite to replace it")
    for name in ("context", "refresh", "part_windows"):
        if getattr(args, name) < 1:
            raise PlanError(f"--{name.replace('_', '-')} {getattr(args, name)}; allowed: an integer >= 1")
    base = ConversionPlan.from_yaml(args.plan)
    if base.csa2 is None:
        raise PlanError(f"--plan {args.plan!r} has no csa2 section; the search keeps its window, top_k, reader and "
                        "indexer settings and the mla section, and chooses csa2.layers")
    other = base.csa2.other_mode if base.csa2.layers is None else "reuse"
    if base.csa2.layers is not None:
        _log("plan search: the base plan's csa2.layers are replaced; demoted layers become reuse "
             "(set csa2.full_every and csa2.other_mode to search with another mode)")
    if other not in SEARCH_OTHER_MODES:
        raise PlanError(f"csa2.other_mode={other!r}; allowed for the search: {', '.join(SEARCH_OTHER_MODES)}")
    kind, path = resolve_source(args.source)
    source_kv = config_kv_elements_at_context(peek_config(kind, path), args.context) / args.context
    try:
        budget = parse_kv_budget(args.kv_budget, source_kv)
    except ValueError as err:
        raise PlanError(str(err)) from err
    base.csa2.layers, base.csa2.full_every = None, 1  # every layer full: valid for any source while checking
    prepared = prepare_source(args.source, base, _log)
    # the search starts from what the csa2 stage of `convert` would get (after gqa / sinks)
    model = run_stages(prepared.model, base, prepared.calib, before="csa2")
    try:
        result = search_plan(model, prepared.calib.fit, prepared.calib.score, csa2_arguments(base),
                             kv_budget=budget, context=args.context, other_mode=other, refresh=args.refresh,
                             part_windows=args.part_windows, swa_pass=args.swa_pass, log=_log)
    except ValueError as err:
        raise PlanError(str(err)) from err
    table = format_curve(result)
    print(table)
    base.csa2.layers, base.csa2.full_every = result.final.modes, None
    header = [f"CSA2 layer plan chosen by: hf-csa2 {' '.join(args.argv)}",
              f"budget {budget:.1f} KV elements/token at a {args.context}-token context "
              f"(source {source_kv:.1f}); {result.evaluations} plans scored on the calibration windows.",
              f"chosen: full layers {result.chosen.full_layers or 'none'}, calib ppl {result.chosen.calib_ppl:.3f}"
              + (f"; uniform with as many full layers {result.uniform.full_layers}: {result.uniform.calib_ppl:.3f}"
                 if result.uniform is not None else "")
              + (f"; swa pass: {result.swa_pass.calib_ppl:.3f}" if result.swa_pass is not None else ""),
              "calib ppl below: plans assembled from parts fitted on the all-full model (a proxy);",
              "convert the plan for its real figures.", ""] + table.splitlines()
    out.parent.mkdir(parents=True, exist_ok=True)
    body = yaml.safe_dump(base.to_dict(), sort_keys=False, default_flow_style=None, width=120)
    out.write_text("".join(f"# {line}".rstrip() + "\n" for line in header) + body)
    if args.json:
        Path(args.json).write_text(json.dumps(result.as_dict(), indent=2))
    _log(f"wrote {out}")
    return 0


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-csa2", description="Attention surgery for Hugging Face causal LMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("convert", help="convert a checkpoint following a plan")
    p.add_argument("source", help="Hub model ID (local cache), local folder, .gguf file, or alias (smollm2-135m, gemma3-270m)")
    p.add_argument("--plan", help="plan YAML (see conversion/)")
    p.add_argument("--to", choices=["gqa"], help="shortcut: the surgery target")
    p.add_argument("--kv-heads", type=int, help="with --to gqa: KV heads per layer (1 = MQA); must divide the query heads")
    p.add_argument("--init", choices=GQA_INITS, default="calibrated", help="with --to gqa: how merged KV heads are initialised")
    p.add_argument("--sinks", action="store_true", help="add per-head learnable sink logits (output unchanged at init)")
    p.add_argument("--calib-text", help="calibration text: file, folder, or python-docs:calib (default)")
    p.add_argument("--calib-tokens", type=int, help="calibration tokens (default from the plan)")
    p.add_argument("--out", required=True, help="output folder (HF checkpoint)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.set_defaults(func=_convert)

    p = sub.add_parser("distill", help="(more) distillation of a converted checkpoint toward its source")
    p.add_argument("source", help="the source the checkpoint was converted from (the teacher)")
    p.add_argument("converted", help="a folder written by hf-csa2 convert (its plan gives the calibration windows)")
    p.add_argument("--steps", type=int, help="Adam steps (default: the plan's distill section, else 200)")
    p.add_argument("--lr", type=float)
    p.add_argument("--batch", type=int, help="windows per step")
    p.add_argument("--num-tokens", type=int, help="calibration tokens to distill on")
    p.add_argument("--holdout", type=int, help="windows never trained on that pick the kept state")
    p.add_argument("--every", type=int, help="held-out check every N steps")
    p.add_argument("--trainable", choices=DISTILL_TRAINABLE)
    p.add_argument("--out", required=True, help="output folder (the converted folder is never written)")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=_distill)

    ev = sub.add_parser("eval", help="evaluate models").add_subparsers(dest="eval_command", required=True)
    p = ev.add_parser("ppl", help="perplexity on identical token windows for every model")
    p.add_argument("models", nargs="+", help="models (folders, sources or aliases); ratios are to the first")
    p.add_argument("--text", required=True, help="text file or folder, or python-docs:heldout / python-docs:calib")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--max-windows", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--json", help="write results JSON here")
    p.set_defaults(func=_eval_ppl)

    p = ev.add_parser("needle", help="needle/distractor long-context capabilities, scored separately")
    p.add_argument("models", nargs="+", help="models (folders, sources or aliases) sharing one tokenizer")
    p.add_argument("--out", required=True, help="folder for needle.json, needle.md and heatmaps")
    p.add_argument("--lengths", default="1024,2048,4096", help="context lengths in tokens")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="relative insertion depths")
    p.add_argument("--per-cell", type=int, default=4, help="samples per capability x length x depth")
    p.add_argument("--categories", help="comma-separated subset of local,far,distractor,composition,order,repeated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text", default="python-docs:heldout", help="haystack text: file, folder or named corpus")
    p.add_argument("--no-chat-template", action="store_true", help="feed the raw prompt even if the tokenizer has a chat template")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--export-jsonl", help="also write the samples as JSONL (lm-eval task data)")
    p.set_defaults(func=_eval_needle)

    p = ev.add_parser("report", help="one markdown report: ppl, needle capabilities and cost, original vs converted")
    p.add_argument("models", nargs="+", help="ORIGINAL CONVERTED [...]: the first is the reference")
    p.add_argument("--out", required=True)
    p.add_argument("--text", default="python-docs:heldout")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--max-windows", type=int, default=8)
    p.add_argument("--needle-lengths", default="1024,2048")
    p.add_argument("--needle-depths", default="0,0.5,1")
    p.add_argument("--per-cell", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-chat-template", action="store_true")
    p.add_argument("--bench-lengths", default="1024,2048")
    p.add_argument("--repeats", type=int, default=1)
    p.set_defaults(func=_eval_report)

    p = ev.add_parser("lm", help="lm-eval tasks in-process (HFLM over the loaded model)")
    p.add_argument("model")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names (ours: hf_csa2_needle)")
    p.add_argument("--include_path", "--include-path", action="append", help="extra task folders (default: the repo's evals/)")
    p.add_argument("--metadata", help="JSON passed to the tasks, e.g. '{\"needle_jsonl\": \"samples.jsonl\"}'")
    p.add_argument("--limit", type=float, default=None)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--apply-chat-template", action="store_true")
    p.add_argument("--json", help="write the results JSON here")
    p.set_defaults(func=_eval_lm)

    p = sub.add_parser("bench", help="prefill / TTFT / decode / peak RSS / KV bytes, models interleaved in one process")
    p.add_argument("models", nargs="+", help="models (folders, sources or aliases); ratios are to the first")
    p.add_argument("--lengths", default="2048,4096,8192", help="prompt lengths in tokens")
    p.add_argument("--new-tokens", type=int, default=16, help="decode steps timed per measurement")
    p.add_argument("--repeats", type=int, default=3, help="medians over this many interleaved repeats")
    p.add_argument("--batch", type=int, default=1, help="concurrent sequences")
    p.add_argument("--json", help="write every run and the medians here")
    p.set_defaults(func=_bench)

    p = sub.add_parser("inspect", help="per-layer attention kinds and measured KV-cache size")
    p.add_argument("model")
    p.add_argument("--tokens", type=int, default=16, help="prefill length for the live-cache measurement")
    p.add_argument("--context", type=int, help="also measure the live cache after a prefill of this many tokens "
                   "(windowed layers keep only their window, so the per-token cost depends on it)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_inspect)

    p = sub.add_parser("plan", help="search the CSA2 layer plan (which layers are full) for a KV budget; writes a plan YAML")
    p.add_argument("source", help="source model (folder, GGUF, Hub ID or alias)")
    p.add_argument("--kv-budget", required=True,
                   help="KV elements per token at --context (e.g. 960) or a fraction of the source's (e.g. 1/12)")
    p.add_argument("--plan", required=True, help="base plan YAML (mla, csa2 and calibration sections); the search "
                   "keeps its settings and chooses csa2.layers")
    p.add_argument("--out", required=True, help="plan YAML to write")
    p.add_argument("--context", type=int, default=8192, help="context length at which the KV budget is counted")
    p.add_argument("--refresh", type=int, default=4, help="stale candidates re-scored per greedy step")
    p.add_argument("--part-windows", type=int, default=4,
                   help="calibration windows each per-layer part (reader, bias, o_proj) is fitted on during the search")
    p.add_argument("--swa-pass", action="store_true",
                   help="then try each reading layer of the chosen plan as swa (own window only; same KV) and keep it "
                        "where the calibration loss falls")
    p.add_argument("--json", help="also write the trade-off curve as JSON")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=_plan)

    p = sub.add_parser("export", help="write a converted checkpoint in a stock transformers architecture")
    p.add_argument("model", help="hf_csa2 checkpoint folder")
    p.add_argument("--format", default="deepseek_v3", help="target format (allowed: deepseek_v3)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # recorded in reports so they can be reproduced
    progress = logging.StreamHandler(sys.stderr)
    progress.setFormatter(logging.Formatter("%(message)s"))
    package_logger = logging.getLogger("hf_csa2")
    if not package_logger.handlers:
        package_logger.addHandler(progress)
    package_logger.setLevel(logging.INFO)
    from .data.corpus import CorpusError
    from .export.deepseek_v3 import ExportError
    from .surgery.pipeline import OutputExistsError
    from .surgery.sources import SourceError

    try:
        return args.func(args)
    except (PlanError, SourceError, OutputExistsError, CorpusError, ExportError) as err:
        print(f"hf-csa2: error: {err}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
