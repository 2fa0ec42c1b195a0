"""The ``hf-csa2`` command line: one tool, subcommands.

    hf-csa2 convert SOURCE (--plan YAML | --to gqa --kv-heads N [--init ...]) [--sinks] [--set S.F=V] --out DIR
                    [--push-to-hub REPO_ID [--private] [--license ID] [--base-model ID]]
    hf-csa2 distill SOURCE CONVERTED --out DIR [--steps N] [--lr X] [--trainable attention|all]
    hf-csa2 train RECIPE.yaml [--set FIELD=VALUE ...] [--out DIR] [--resume [DIR]] [--overwrite]
                  [--push-to-hub REPO_ID [--private] [--license ID] [--base-model ID]]
    hf-csa2 eval ppl MODEL [MODEL ...] --text FILE_OR_DIR [--window 512] [--max-windows N] [--json OUT]
    hf-csa2 eval needle MODEL [MODEL ...] --out DIR [--lengths 1024,2048,4096] [--per-cell 4]
    hf-csa2 eval lm MODEL --tasks T1,T2 [--metadata JSON] [--include_path DIR]
    hf-csa2 eval report ORIGINAL CONVERTED [...] --out DIR
    hf-csa2 eval compare SOURCE CONVERTED --text TEXT --context N [--max-windows 1] [--bucket 512] [--json OUT]
    hf-csa2 eval retrieval-layers MODEL [--context 512] [--window 128] [--sufficient] [--json OUT]
    hf-csa2 bench MODEL [MODEL ...] [--lengths 2048,4096,8192] [--new-tokens 16] [--repeats 3] [--batch 1]
    hf-csa2 inspect MODEL [--json]
    hf-csa2 plan SOURCE --kv-budget X --plan BASE_YAML --out PLAN_YAML [--context 8192] [--swa-pass]
                 [--no-retrieval-scan] [--retrieval-mode lowrank|full] [--keep-full LAYERS]
    hf-csa2 export DIR --format deepseek_v3 --out OUT [--overwrite]
    hf-csa2 push DIR REPO_ID [--private] [--revision BRANCH] [--create-pr] [--commit-message M]
                 [--format native|deepseek_v3] [--dry-run] [--include PATTERN] [--license ID] [--base-model ID]
                 [--eval RESULT.json ...]
    hf-csa2 card DIR [--repo-id REPO_ID] [--out FILE] [--license ID] [--base-model ID] [--eval RESULT.json ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import math
import shlex
import sys
from pathlib import Path

import yaml

from .data.corpus import read_text, resolve_text
from .data.windows import token_windows
from .errors import InputError, UserError, one_line
from .evals.answers import compare_answers, format_answers_table, write_answers_json
from .evals.bench import bench, format_bench_table
from .evals.compare import compare_models, format_compare_tables, write_compare_json
from .evals.lm_eval_glue import (
    check_tasks,
    run_lm_eval,
    summarise,
    task_manager,
    write_results,
)
from .evals.needle import CATEGORIES, PROMPT_STYLES, generate_samples, prompt_style, write_jsonl
from .evals.needle_eval import (
    OutputJournal,
    generate_answers,
    score_records,
    write_reports,
)
from .evals.ppl import compare_ppl, format_ppl_table, write_ppl_json
from .evals.window_baseline import parse_window_model, window_model
from .evals.report import ReportSettings, write_report
from .export.deepseek_v3 import export_checkpoint
from .publish import PushOptions, push, write_card
from .publish.push import check_push_after
from .io.output import check_output_file, check_results_dir
from .io.sources import instruction_tuned, load_source, peek_config, resolve_source
from .metrics.answer_check import make_probes
from .metrics.restored_layers import scan_restored_layers
from .metrics.retrieval_layers import scan_retrieval_layers, sufficient_far_layers
from .metrics.kv_cache import (
    config_kv_elements_at_context,
    config_kv_elements_per_token,
    described_layers,
    format_layer_table,
    measure_kv_elements_at_context,
    measure_kv_elements_per_token,
    measurement_length,
)
from .model.configuration_hf_csa2 import attention_head_dim
from .train.recipe import RecipeError, load_recipe
from .train.run import run_recipe
from .surgery.pipeline import (
    conversion_inputs,
    convert,
    distill_checkpoint,
    format_report_table,
    prepare_source,
    run_stages,
)
from .surgery.plan import ConversionPlan, PlanError, plan_fields, set_fields
from .surgery.plan_search import (
    SEARCH_OTHER_MODES,
    format_curve,
    parse_kv_budget,
    search_plan,
)

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it


# -- argument types: every flag is checked while parsing, before any work starts ------------

def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}; allowed: an integer >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}; allowed: an integer >= 1")
    return value


def _window_length(text: str) -> int:
    value = _positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"{value}; allowed: an integer >= 2 (the first token is never predicted)")
    return value


def _positive_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}; allowed: a finite number > 0") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text}; allowed: a finite number > 0")
    return value


def _limit(text: str) -> float:
    value = _positive_number(text)
    if value > 1 and value != int(value):
        raise argparse.ArgumentTypeError(f"{text}; allowed: a fraction in (0, 1] or a whole number of examples")
    return value


class _PlanFlags:
    """Flags generated from plan fields (:func:`~hf_csa2.surgery.plan.plan_fields`): one per
    field, named after it (``--num-tokens`` for ``num_tokens``, with ``prefix``), its
    description as help, its literals as choices; each value is checked against the field
    while parsing. ``aliases``: older spellings kept working ({field: flag})."""

    def __init__(self, parser: argparse.ArgumentParser, section: str, *, prefix: str = "",
                 aliases: dict[str, str] | None = None):
        self.dests: dict[str, str] = {}
        for f in plan_fields(section):
            flags = [f"--{prefix}{f.name.replace('_', '-')}"]
            if aliases and f.name in aliases:
                flags.insert(0, aliases[f.name])
            dest = f"{section}__{f.name}"
            default = f"; default {f.default}" if f.default is not None else ""
            kwargs = dict(dest=dest, default=None, help=f"{f.description} (plan field {f.path}{default})")
            if f.choices is not None:
                kwargs["choices"] = f.choices
            elif f.base is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = _field_value(f)
                kwargs["metavar"] = f.name.upper()
            parser.add_argument(*flags, **kwargs)
            self.dests[f.name] = dest

    def values(self, args) -> dict:
        """{field: value} of the flags given."""
        return {name: getattr(args, dest) for name, dest in self.dests.items() if getattr(args, dest) is not None}


def _field_value(f):
    def parse(text: str):
        try:
            value = f.base(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}; allowed: {f.allowed}") from None
        try:
            return f.validate(value)
        except PlanError:
            raise argparse.ArgumentTypeError(f"{text}; allowed: {f.allowed}") from None

    parse.__name__ = f.base.__name__  # argparse names the type in its messages
    return parse


def _source_name(name: str) -> str:
    """The checkpoint a model argument loads (a window baseline's SOURCE)."""
    baseline = parse_window_model(name)
    return baseline.source if baseline else name


def _models(names: list[str]) -> list[tuple[str, Path]]:
    """Every model argument resolved (a missing one fails before any is loaded)."""
    return [("model", resolve_source(_source_name(name))[1]) for name in names]


def _load(name: str, args):
    """A model argument loaded: a checkpoint, or a window baseline ``window:W+P:SOURCE`` built on one."""
    baseline = parse_window_model(name)
    loaded = load_source(_source_name(name), check_supported=False, trust_remote_code=args.trust_remote_code)
    if baseline is None:
        return loaded
    model = window_model(loaded.model, baseline.window, baseline.first)
    model.config._name_or_path = name
    return dataclasses.replace(loaded, model=model, name=name)


def _convert(args) -> int:
    gqa = args.gqa_flags.values(args)
    if args.plan and (args.to or gqa):
        raise PlanError("give either --plan or --to gqa with its flags (--kv-heads ...), not both")
    if args.plan:
        data = ConversionPlan.from_yaml(args.plan).to_dict()
        if args.sinks and data.get("sinks") is None:
            data["sinks"] = {}
    else:
        if args.to is None and gqa:
            raise PlanError("--kv-heads/--gqa-* flags need --to gqa")
        if args.to is None and not args.sinks and not args.set:
            raise PlanError("nothing to do: give --plan YAML, --to gqa --kv-heads N, --sinks, or --set SECTION.FIELD=VALUE")
        if args.to == "gqa" and "num_key_value_heads" not in gqa:
            raise PlanError("--to gqa needs --kv-heads N (N must divide the number of query heads)")
        data = {"gqa": gqa if args.to == "gqa" else None, "sinks": {} if args.sinks else None}
    data["calibration"] = {**(data.get("calibration") or {}), **args.calibration_flags.values(args)}
    plan = ConversionPlan.from_dict(set_fields(data, args.set or []))
    if args.push_to_hub:
        check_push_after(args.push_to_hub, args.source, _push_options(args))
    result = convert(args.source, plan, out_dir=args.out, overwrite=args.overwrite, log=_log, plan_path=args.plan,
                     trust_remote_code=args.trust_remote_code, revision=args.revision, offline=args.offline or None)
    print(format_report_table(result.report))
    if args.push_to_hub:
        push(args.out, args.push_to_hub, _push_options(args), log=_log)
    return 0


def _distill(args) -> int:
    result = distill_checkpoint(args.source, args.converted, out_dir=args.out, overrides=args.distill_flags.values(args),
                                overwrite=args.overwrite, log=_log, trust_remote_code=args.trust_remote_code)
    print(format_report_table(result.report))
    return 0


def _train(args) -> int:
    recipe = load_recipe(args.recipe, args.set or [])
    resume = args.resume is not None
    out = args.out or (args.resume if isinstance(args.resume, str) else None)
    if out is None:
        out = f"runs/train/{Path(args.recipe).stem}"
    elif isinstance(args.resume, str) and args.out and Path(args.resume).absolute() != Path(args.out).absolute():
        raise RecipeError(f"--resume {args.resume!r} and --out {args.out!r} name different folders; give one")
    if args.push_to_hub:
        check_push_after(args.push_to_hub, recipe.student, _push_options(args))
    report = run_recipe(recipe, out, resume=resume, overwrite=args.overwrite, log=_log)
    if args.push_to_hub:
        push(Path(out) / "merged", args.push_to_hub, _push_options(args), log=_log)
    history = [h for h in report["history"] if any(k.endswith("_ppl_ratio") for k in h)]
    if history:
        last = history[-1]
        ratios = ", ".join(f"{k.removeprefix('eval_').removesuffix('_ppl_ratio')} {v:.3f}" for k, v in last.items()
                           if k.endswith("_ppl_ratio"))
        answers = "".join(f"; {k.removeprefix('eval_').removesuffix('_answers_far')} answers far {v}"
                          f"/{recipe.eval.answers} near {last[k.removesuffix('_far') + '_near']}/{recipe.eval.answers}"
                          for k, v in last.items() if k.endswith("_answers_far"))
        print(f"trained {report['steps']} steps ({report['tokens_seen']:,} tokens, {report['seconds']:.0f} s); "
              f"held-out ppl ratio to the teacher: {ratios}{answers}; outputs in {out}")
    return 0


def _command(args) -> str:
    """The command line that ran, as written into result files (quoted where a shell needs it)."""
    return "hf-csa2 " + shlex.join(args.argv)


def _compare_on_text(args, run, table, write) -> int:
    """Every model of ``args.models`` (loaded one at a time) measured on ``args.text`` by
    ``run(entries)``; the ``table`` printed, the JSON written by ``write(results, path)`` with --json."""
    inputs = _models(args.models) + [("text", resolve_text(args.text))]
    if args.json:
        check_output_file(args.json, inputs=inputs)
    results = run([(name, (lambda n=name: _load(n, args))) for name in args.models])
    print(table(results))
    if args.json:
        write(results, args.json)
    return 0


def _eval_ppl(args) -> int:
    return _compare_on_text(
        args, lambda entries: compare_ppl(entries, args.text, window=args.window, max_windows=args.max_windows,
                                          batch_size=args.batch_size),
        format_ppl_table, lambda results, path: write_ppl_json(results, path, command=_command(args)))


def _eval_answers(args) -> int:
    return _compare_on_text(
        args, lambda entries: compare_answers(entries, args.text, context=args.context, per_depth=args.per_depth,
                                              seed=args.seed),
        format_answers_table, lambda results, path: write_answers_json(results, path, text=args.text, seed=args.seed))




def _eval_compare(args) -> int:
    inputs = _models([args.source, args.converted]) + [("text", resolve_text(args.text))]
    if args.json:
        check_output_file(args.json, inputs=inputs)
    source = _load(args.source, args)
    converted = _load(args.converted, args)
    windows = token_windows(source.tokenizer, args.text, window=args.context, max_windows=args.max_windows)
    report = compare_models(source.model, converted.model, windows, bucket=args.bucket)
    print(format_compare_tables(report))
    if args.json:
        write_compare_json(report, args.json, source=args.source, converted=args.converted, text=args.text)
    return 0


def _eval_retrieval_layers(args) -> int:
    if not 0 < args.drop <= 1:
        raise InputError(f"--drop {args.drop}; allowed: a share in (0, 1]")
    if not 0 < args.keep <= 1:
        raise InputError(f"--keep {args.keep}; allowed: a share in (0, 1]")
    if args.sink_tokens < 0:
        raise InputError(f"--sink-tokens {args.sink_tokens}; allowed: an integer >= 0")
    if args.window >= 0.85 * args.context:
        raise InputError(f"--window {args.window} reaches the far facts of {args.context}-token probes; allowed: "
                         f"< {int(0.85 * args.context)}")
    inputs = _models([args.model]) + [("text", resolve_text(args.text))]
    if args.json:
        check_output_file(args.json, inputs=inputs)
    source = _load(args.model, args)
    windows = token_windows(source.tokenizer, args.text, window=args.context, max_windows=args.windows)
    probes = make_probes(source.tokenizer, windows, args.per_depth)
    scan = scan_retrieval_layers(source.model, probes, args.window, drop=args.drop, sink_tokens=args.sink_tokens)
    print(scan.table())
    result = {"model": args.model, "text": args.text, "context": args.context, "scan": scan.as_dict()}
    if args.sufficient:
        found = sufficient_far_layers(source.model, probes, args.window, sink_tokens=args.sink_tokens, keep=args.keep,
                                      log=_log)
        print()
        print(found.table())
        result["sufficient"] = {**dataclasses.asdict(found), "layers": found.layers}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0


def _eval_restore_layers(args) -> int:
    if args.distractors < 0:
        raise InputError(f"--distractors {args.distractors}; allowed: an integer >= 0")
    inputs = _models([args.source, args.converted]) + [("text", resolve_text(args.text))]
    if args.json:
        check_output_file(args.json, inputs=inputs)
    source = _load(args.source, args)
    converted = _load(args.converted, args)
    if converted.tokenizer.get_vocab() != source.tokenizer.get_vocab():
        raise InputError(f"{args.converted}: its tokenizer differs from {args.source}'s; the probes are the same token "
                         "ids for both, so they must share one tokenizer")
    windows = token_windows(source.tokenizer, args.text, window=args.context, max_windows=args.windows)
    try:
        probes = make_probes(source.tokenizer, windows, args.per_depth, seed=args.seed, distractors=args.distractors)
    except ValueError as err:
        raise InputError(f"--context {args.context}: {err}") from None
    scan = scan_restored_layers(source.model, converted.model, probes)
    print(scan.table())
    if args.json:
        Path(args.json).write_text(json.dumps({"source": args.source, "converted": args.converted, "text": args.text,
                                               "context": args.context, "distractors": args.distractors,
                                               "seed": args.seed, "scan": scan.as_dict()}, indent=2))
    return 0


def _probe_arguments(p, *, text: str, per_depth_help: str, windows: int) -> None:
    """The answer-check probe options shared by the layer scans: filler text, probe length, count."""
    p.add_argument("--text", default=text, help="filler text the probes are cut from")
    p.add_argument("--context", type=_window_length, default=512, help="tokens per probe")
    p.add_argument("--per-depth", type=_positive_int, default=10, help=per_depth_help)
    p.add_argument("--windows", type=_positive_int, default=windows, help="text windows the probes are cut from")


def _prompt_style(tokenizer, requested: str, model: str) -> str:
    """The needle prompt style for ``model`` (``--prompt-style``; auto: chat for an instruction-tuned
    model with a chat template, completion for a base model), logged with the reason."""
    instruct = instruction_tuned(_source_name(model))
    style = prompt_style(tokenizer, requested, instruct)
    if requested == "auto":
        why = ("instruction-tuned, with a chat template" if style == "chat" else
               "a chat template but no instruction-tuned name (Instruct, -it, chat) in its lineage" if
               getattr(tokenizer, "chat_template", None) else "no chat template")
        _log(f"needle prompts: {style} ({model}: {why}; --prompt-style chat|completion overrides)")
    return style


def _eval_needle(args) -> int:
    categories = args.categories.split(",") if args.categories else list(CATEGORIES)
    bad = [c for c in categories if c not in CATEGORIES]
    if bad:
        raise InputError(f"--categories {bad}; allowed: {', '.join(CATEGORIES)}")
    lengths = _int_list(args.lengths, "--lengths")
    depths = _float_list(args.depths, "--depths")
    if any(not 0.0 <= d <= 1.0 for d in depths):
        raise InputError(f"--depths {depths}; allowed: numbers in [0, 1]")
    inputs = _models(args.models) + [("haystack text", resolve_text(args.text))]
    check_results_dir(args.out, inputs=inputs)
    if args.export_jsonl:
        check_output_file(args.export_jsonl, inputs=inputs, flag="--export-jsonl")
    text = read_text(resolve_text(args.text), max_chars=4_000_000)
    settings = {"models": list(args.models), "categories": categories, "lengths": lengths, "depths": depths,
                "per_cell": args.per_cell, "seed": args.seed, "text": args.text,
                "chat_template": not args.no_chat_template, "max_new_tokens": args.max_new_tokens,
                "prompt_style": args.prompt_style}
    journal = OutputJournal(Path(args.out) / "needle.partial.jsonl", settings)
    results, samples = {}, None
    for name in args.models:
        loaded = _load(name, args)
        if samples is None:  # one sample set, made with the first model's tokenizer, for every model
            style = _prompt_style(loaded.tokenizer, args.prompt_style, args.models[0])
            settings = {**settings, "prompt_style_used": style}
            samples = generate_samples(loaded.tokenizer, text, categories=categories, lengths=lengths,
                                       depths=depths, per_cell=args.per_cell, seed=args.seed, style=style)
            if args.export_jsonl:
                write_jsonl(samples, args.export_jsonl)
            _log(f"{len(samples)} samples: {len(categories)} capabilities x {len(lengths)} lengths x "
                 f"{len(depths)} depths x {args.per_cell}, {style} prompts")
        done = journal.done.get(name, {})
        if done:
            _log(f"{name}: resuming, {len(done)} of {len(samples)} samples already answered ({journal.path})")
        outputs = generate_answers(loaded.model, loaded.tokenizer, samples, chat_template=not args.no_chat_template,
                                   max_new_tokens=args.max_new_tokens, done=done, on_output=journal.writer(name))
        results[name] = score_records(samples, outputs)
        del loaded
        gc.collect()
    paths = write_reports(results, args.out, {**settings, "command": _command(args)})  # not in the journal: resumable
    print(paths["table"])
    _log(f"wrote {paths['json']}, {paths['markdown']} and {len(paths['heatmaps'])} heatmaps")
    return 0


def _eval_lm(args) -> int:
    try:
        metadata = json.loads(args.metadata) if args.metadata else None
    except json.JSONDecodeError as err:
        raise InputError(f"--metadata is not valid JSON: {err}") from None
    if metadata is not None and not isinstance(metadata, dict):
        raise InputError(f"--metadata {args.metadata!r}; allowed: a JSON object, e.g. '{{\"needle_jsonl\": \"s.jsonl\"}}'")
    inputs = _models([args.model])
    if args.json:
        check_output_file(args.json, inputs=inputs)
    kind, path = resolve_source(_source_name(args.model))
    window = parse_window_model(args.model)
    if args.batch_size > 1 and ((window is not None and window.first > 0) or _keeps_first_tokens(
            peek_config(kind, path, trust_remote_code=args.trust_remote_code))):
        raise InputError(f"--batch-size {args.batch_size}: {args.model!r} keeps its first tokens for good (CSA2 "
                         "sink_tokens), which left padding would fill with pads; allowed: --batch-size 1")
    tasks = [t for t in args.tasks.split(",") if t.strip()]
    manager = task_manager(args.include_path, metadata)
    check_tasks(tasks, manager)
    loaded = _load(args.model, args)
    results = run_lm_eval(
        loaded.model, loaded.tokenizer, tasks, include_paths=args.include_path, metadata=metadata,
        limit=args.limit, batch_size=args.batch_size, apply_chat_template=args.apply_chat_template, manager=manager,
    )
    print(summarise(results))
    if args.json:
        write_results(results, args.json)
    return 0


def _keeps_first_tokens(config) -> bool:
    return any(spec.get("sink_tokens") for spec in getattr(config, "attention_layers", None) or [])


def _eval_report(args) -> int:
    settings = ReportSettings(
        text=args.text, window=args.window, max_windows=args.max_windows,
        needle_lengths=_int_list(args.needle_lengths, "--needle-lengths"),
        needle_depths=_float_list(args.needle_depths, "--needle-depths"), per_cell=args.per_cell, seed=args.seed,
        chat_template=not args.no_chat_template, bench_lengths=_int_list(args.bench_lengths, "--bench-lengths"),
        bench_repeats=args.repeats,
    )
    check_results_dir(args.out, inputs=_models(args.models) + [("text", resolve_text(args.text))])
    loaded = [_load(name, args) for name in args.models]
    settings.prompt_style = _prompt_style(loaded[0].tokenizer, args.prompt_style, args.models[0])
    models = [(name, src.model, src.tokenizer) for name, src in zip(args.models, loaded)]
    path = write_report(models, args.out, settings, command=_command(args), log=_log)
    print(path.read_text())
    return 0


def _bench(args) -> int:
    lengths = _int_list(args.lengths, "--lengths")
    inputs = _models(args.models)
    if args.json:
        check_output_file(args.json, inputs=inputs)
    models = [(name, _load(name, args).model) for name in args.models]  # all resident: measurements interleave
    rows = bench(models, lengths, new_tokens=args.new_tokens, repeats=args.repeats, batch=args.batch, log=_log)
    print(format_bench_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "command": _command(args)}, indent=1))
    return 0


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"{flag} {text!r}; allowed: comma-separated positive integers, e.g. 1024,2048") from None
    if not values or any(v < 1 for v in values):
        raise InputError(f"{flag} {text!r}; allowed: comma-separated positive integers, e.g. 1024,2048")
    return values


def _layer_indices(text: str, flag: str) -> list[int]:
    try:
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        values = []
    if not values or values[0] < 0:
        raise InputError(f"{flag} {text!r}; allowed: comma-separated layer indices, e.g. 11,17")
    return values


def _float_list(text: str, flag: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"{flag} {text!r}; allowed: comma-separated numbers, e.g. 0,0.5,1") from None
    if not values or not all(math.isfinite(v) for v in values):
        raise InputError(f"{flag} {text!r}; allowed: comma-separated finite numbers, e.g. 0,0.5,1")
    return values


def _inspect(args) -> int:
    loaded = _load(args.model, args)
    cfg = loaded.model.config
    layers = described_layers(cfg)
    head_dim = attention_head_dim(cfg)
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
    print(format_layer_table(layers))
    print(f"KV elements per token: config {info['kv_elements_per_token_config']}, "
          f"measured from the live cache after a {info['measured_with_tokens']}-token prefill {info['kv_elements_per_token_measured']:.0f}")
    if args.context:
        print(f"KV elements per token at a {args.context}-token context: config "
              f"{info['kv_elements_per_token_at_context_config']:.1f}, live cache {info['kv_elements_per_token_at_context_measured']:.1f}")
    return 0


def _export(args) -> int:
    out = export_checkpoint(args.model, args.out, args.format, overwrite=args.overwrite,
                            trust_remote_code=args.trust_remote_code)
    _log(f"saved {out} ({args.format}; loads with AutoModelForCausalLM, no remote code)")
    return 0


def _push_options(args) -> PushOptions:
    return PushOptions(private=getattr(args, "private", False), revision=getattr(args, "hub_revision", None),
                       create_pr=getattr(args, "create_pr", False), commit_message=getattr(args, "commit_message", None),
                       format=getattr(args, "format", "native"), include=tuple(getattr(args, "include", None) or ()),
                       license=args.license, base_model=args.base_model, eval_files=tuple(args.eval or ()))


def _push(args) -> int:
    push(args.folder, args.repo_id, _push_options(args), dry_run=args.dry_run, log=_log)
    return 0


def _card(args) -> int:
    path = write_card(args.folder, args.out, args.repo_id, _push_options(args))
    _log(f"wrote {path}")
    return 0


def _plan(args) -> int:
    base = ConversionPlan.from_yaml(args.plan)
    if base.csa2 is None or base.mla is None:
        raise PlanError(f"--plan {args.plan!r} has no {'csa2' if base.csa2 is None else 'mla'} section; the search "
                        "keeps its window, top_k, reader and indexer settings and the mla section (it starts from "
                        "every layer full), and chooses csa2.layers")
    other = base.csa2.other_mode if base.csa2.layers is None else "reuse"
    if base.csa2.layers is not None:
        _log("plan search: the base plan's csa2.layers are replaced; demoted layers become reuse "
             "(set csa2.full_every and csa2.other_mode to search with another mode)")
    if other not in SEARCH_OTHER_MODES:
        raise PlanError(f"csa2.other_mode={other!r}; allowed for the search: {', '.join(SEARCH_OTHER_MODES)}")
    if not 0 < args.retrieval_drop <= 1:
        raise InputError(f"--retrieval-drop {args.retrieval_drop}; allowed: a share in (0, 1]")
    keep_full = _layer_indices(args.keep_full, "--keep-full") if args.keep_full is not None else []
    kind, path = resolve_source(args.source)
    inputs = conversion_inputs(path, base, args.plan)
    out = check_output_file(args.out, inputs=inputs, flag="--out", overwrite=args.overwrite)
    if args.json:
        check_output_file(args.json, inputs=inputs + [("--out file", out)])
    source_config = peek_config(kind, path, trust_remote_code=args.trust_remote_code)
    source_kv = config_kv_elements_at_context(source_config, args.context) / args.context
    budget = parse_kv_budget(args.kv_budget, source_kv)
    num_layers = source_config.num_hidden_layers
    if any(i >= num_layers for i in keep_full):
        raise InputError(f"--keep-full {args.keep_full}; allowed: layer indices 0..{num_layers - 1}")
    if args.retrieval_scan and args.retrieval_mode == "lowrank":
        kv = base.gqa.num_key_value_heads if base.gqa is not None else (
            getattr(source_config, "num_key_value_heads", None) or source_config.num_attention_heads)
        width = kv * attention_head_dim(source_config)
        for name in ("lowrank_key_rank", "lowrank_value_rank"):
            if (getattr(base.csa2, name) or 0) > width:
                raise PlanError(f"csa2.{name}={getattr(base.csa2, name)} exceeds the source's key/value width {width} "
                                f"(retrieval layers become lowrank); allowed: 1..{width}, or --retrieval-mode full")
    base.csa2.layers, base.csa2.full_every = None, 1  # every layer full: valid for any source while checking
    prepared = prepare_source(args.source, base, _log, trust_remote_code=args.trust_remote_code)
    scan, lowrank_layers = None, []
    probes = prepared.calib.probes
    if args.retrieval_scan and not probes:
        _log("retrieval scan skipped: no answer-check probes (calibration.answer_probes is 0, or the calibration "
             "windows are too short for one)")
    elif args.retrieval_scan:
        _log(f"retrieval scan: each layer of the source alone cut to its last {base.csa2.window} tokens "
             f"(+ the first {base.csa2.sink_tokens}), "
             f"{sum(p.depth == 'far' for p in probes)} far probes of {probes[0].ids.shape[0]} tokens")
        try:
            scan = scan_retrieval_layers(prepared.model, probes, base.csa2.window, drop=args.retrieval_drop,
                                         sink_tokens=base.csa2.sink_tokens)
        except ValueError as err:  # e.g. a window that reaches the far facts of these probes
            _log(f"retrieval scan skipped: {err}")
    if scan is not None:
        print(scan.table())
        if scan.retrieval_layers:
            kept = ("they become lowrank (own keys and values cached as codes: csa2.lowrank_key_rank / lowrank_value_rank)"
                if args.retrieval_mode == "lowrank" else "they stay full")
            _log(f"retrieval layers {scan.retrieval_layers}: reading only their window loses far answers (source "
                 f"{scan.source.far}/{scan.source.per_depth}): {kept} (as swa they would read only that "
                 "window; as reuse, another layer's latent entries)")
        else:
            _log(f"retrieval scan: no layer alone loses {args.retrieval_drop:.0%} of the far answers "
                 f"(source {scan.source.far}/{scan.source.per_depth})")
        if args.retrieval_mode == "lowrank":
            lowrank_layers = [i for i in scan.retrieval_layers if i not in keep_full]
        else:
            keep_full = sorted(set(keep_full) | set(scan.retrieval_layers))
    # the search starts from what the csa2 stage of `convert` would get (after gqa / sinks)
    model = run_stages(prepared.model, base, prepared.calib, before="csa2")
    result = search_plan(model, prepared.calib.fit, prepared.calib.score, base.csa2, base.mla,
                         kv_budget=budget, context=args.context, other_mode=other, refresh=args.refresh,
                         part_windows=args.part_windows, swa_pass=args.swa_pass, keep_full=keep_full,
                         lowrank_layers=lowrank_layers, log=_log)
    table = format_curve(result)
    print(table)
    base.csa2.layers, base.csa2.full_every = result.final.modes, None
    base.context = args.context  # convert then reports the KV cost at the context the budget was set for
    header = [f"CSA2 layer plan chosen by: {_command(args)}",
              f"budget {budget:.1f} KV elements/token at a {args.context}-token context "
              f"(source {source_kv:.1f}); {result.evaluations} plans scored on the calibration windows.",
              f"chosen: full layers {result.chosen.full_layers or 'none'}, calib ppl {result.chosen.calib_ppl:.3f}"
              + (f"; uniform with as many full layers {result.uniform.full_layers}: {result.uniform.calib_ppl:.3f}"
                 if result.uniform is not None else "")
              + (f"; swa pass: {result.swa_pass.calib_ppl:.3f}" if result.swa_pass is not None else ""),
              "calib ppl below: plans assembled from parts fitted on the all-full model (a proxy);",
              "convert the plan for its real figures.", ""]
    if scan is not None:
        header += [f"retrieval scan (far answers with one layer of the source cut to its window; a layer losing "
                   f">= {args.retrieval_drop:.0%} of the source's is {args.retrieval_mode}): kept full "
                   f"{result.kept_full or 'none'}, lowrank {result.lowrank_layers or 'none'}",
                   ""] + scan.table().splitlines() + [""]
    header += table.splitlines()
    out.parent.mkdir(parents=True, exist_ok=True)
    body = yaml.safe_dump(base.to_dict(), sort_keys=False, default_flow_style=None, width=120)
    out.write_text("".join(f"# {line}".rstrip() + "\n" for line in header) + body)
    if args.json:
        Path(args.json).write_text(json.dumps({**result.as_dict(), "retrieval_scan": scan.as_dict() if scan else None},
                                              indent=2))
    _log(f"wrote {out}")
    return 0


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (the usage text is one ``--help`` away)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _trust_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow a model folder to run Python code it ships (auto_map); off by default: hf-csa2 "
                        "checkpoints load through the installed package, tokenizers without any folder code")


def _prompt_style_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-style", choices=("auto",) + PROMPT_STYLES, default="auto",
                   help="needle prompts: chat (instruction, log, question; chat template) or completion (log, then "
                        "the start of the statement the answer completes; for base models); auto: chat for an "
                        "instruction-tuned model with a chat template, else completion")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hf-csa2", description="Attention surgery for Hugging Face causal LMs.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("convert", help="convert a checkpoint following a plan")
    p.add_argument("source", help="Hub model ID, local folder, .gguf file, or alias (smollm2-135m, gemma3-270m)")
    p.add_argument("--plan", help="plan YAML (see conversion/)")
    p.add_argument("--revision", help="with a Hub model ID: branch, tag or commit to download")
    p.add_argument("--offline", action="store_true",
                   help="use the local Hugging Face cache only (as HF_HUB_OFFLINE=1 does); a Hub model ID is "
                        "otherwise downloaded like from_pretrained does: configs, safetensors, tokenizer")
    p.add_argument("--to", choices=["gqa"], help="shortcut: the surgery target (with the --gqa-* flags below)")
    p.set_defaults(gqa_flags=_PlanFlags(p, "gqa", prefix="gqa-",
                                        aliases={"num_key_value_heads": "--kv-heads", "init": "--init"}))
    p.add_argument("--sinks", action="store_true", help="add per-head learnable sink logits (output unchanged at init)")
    p.set_defaults(calibration_flags=_PlanFlags(p, "calibration", prefix="calib-", aliases={"num_tokens": "--calib-tokens"}))
    p.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE",
                   help="set any plan field (VALUE read as YAML), after --plan and the flags above; e.g. "
                        "--set context=4096 --set csa2.top_k=128; repeatable (see docs/plans.md)")
    p.add_argument("--out", required=True, help="output folder (HF checkpoint); never an input or a folder holding one")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder that hf-csa2 wrote")
    _trust_flag(p)
    _push_flags(p, "the converted folder")
    p.set_defaults(func=_convert)

    p = sub.add_parser("distill", help="(more) distillation of a converted checkpoint toward its source")
    p.add_argument("source", help="the source the checkpoint was converted from (the teacher)")
    p.add_argument("converted", help="a folder written by hf-csa2 convert (its plan gives the calibration windows)")
    # defaults: the checkpoint's own plan (its distill section), else the field defaults shown
    p.set_defaults(distill_flags=_PlanFlags(p, "distill"))
    p.add_argument("--out", required=True, help="output folder (the converted folder is never written)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder that hf-csa2 wrote")
    _trust_flag(p)
    p.set_defaults(func=_distill)

    p = sub.add_parser("train", help="uplift a converted checkpoint: distillation toward its source (PEFT + Trainer)")
    p.add_argument("recipe", help="recipe YAML (see recipes/)")
    p.add_argument("--set", action="append", metavar="FIELD=VALUE",
                   help="override a recipe field by its dotted path, e.g. --set student=runs/mqa --set optim.lr=2.0e-4")
    p.add_argument("--out", help="output folder (default runs/train/<recipe name>)")
    p.add_argument("--resume", nargs="?", const=True, metavar="DIR",
                   help="continue from the newest checkpoint in --out (or DIR)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder that hf-csa2 wrote")
    _push_flags(p, "the merged checkpoint (OUT/merged)")
    p.set_defaults(func=_train)

    ev = sub.add_parser("eval", help="evaluate models").add_subparsers(dest="eval_command", required=True,
                                                                       parser_class=_Parser)
    p = ev.add_parser("ppl", help="perplexity on identical token windows for every model")
    p.add_argument("models", nargs="+", help="models (folders, sources or aliases); ratios are to the first")
    p.add_argument("--text", required=True, help="text file or folder, or a named corpus: python-docs:heldout, fortunes:heldout (…:calib)")
    p.add_argument("--window", type=_window_length, default=512)
    p.add_argument("--max-windows", type=_positive_int, default=None)
    p.add_argument("--batch-size", type=_positive_int, default=1)
    p.add_argument("--json", help="write results JSON here (a file)")
    _trust_flag(p)
    p.set_defaults(func=_eval_ppl)

    p = ev.add_parser("answers", help="facts planted far back / near the end of real text, asked back (answer check)")
    p.add_argument("models", nargs="+", help="models (folders, sources or aliases) sharing one tokenizer")
    p.add_argument("--text", default="python-docs:heldout", help="text file or folder, or a named corpus (the filler)")
    p.add_argument("--context", type=_window_length, default=512, help="tokens per probe")
    p.add_argument("--per-depth", type=_positive_int, default=20, help="probes per depth (far, near)")
    p.add_argument("--seed", type=int, default=0, help="which facts and names are drawn")
    p.add_argument("--json", help="write results JSON here (a file)")
    _trust_flag(p)
    p.set_defaults(func=_eval_answers)

    p = ev.add_parser("compare", help="where a conversion departs from its source: per position bucket and per layer")
    p.add_argument("source")
    p.add_argument("converted")
    p.add_argument("--text", default="python-docs:heldout", help="text file or folder, or a named corpus")
    p.add_argument("--context", type=_window_length, default=2048, help="tokens per window")
    p.add_argument("--max-windows", type=_positive_int, default=1)
    p.add_argument("--bucket", type=_positive_int, default=512, help="positions per row of the first table")
    p.add_argument("--json", help="write the report JSON here (a file)")
    _trust_flag(p)
    p.set_defaults(func=_eval_compare)

    p = ev.add_parser("retrieval-layers", help="which layers read facts back from far in the prompt: each layer "
                      "alone cut to a window, far answers re-asked (and with --sufficient, the layers that must read far)")
    p.add_argument("model")
    _probe_arguments(p, text="python-docs:heldout", per_depth_help="far probes", windows=3)
    p.add_argument("--window", type=_positive_int, default=128, help="tokens a cut layer still reads before each query")
    p.add_argument("--sink-tokens", type=int, default=4, help="first tokens a cut layer still reads (as a CSA2 swa layer)")
    p.add_argument("--drop", type=float, default=0.5, help="share of the far answers a cut must lose (retrieval layer)")
    p.add_argument("--sufficient", action="store_true", help="then cut every layer and give far reads back greedily "
                   "until --keep of the far answers return")
    p.add_argument("--keep", type=float, default=0.8, help="share of the source's far answers --sufficient must bring back")
    p.add_argument("--json", help="write both scans as JSON here (a file)")
    _trust_flag(p)
    p.set_defaults(func=_eval_retrieval_layers)

    p = ev.add_parser("restore-layers", help="which layers' conversion costs the answers most: each layer of CONVERTED "
                      "alone given SOURCE's attention back, the answer check (with lookalike facts) re-asked")
    p.add_argument("source")
    p.add_argument("converted", help="a conversion of SOURCE with the same layers (e.g. a GQA/MQA checkpoint)")
    _probe_arguments(p, text="python-docs:calib", per_depth_help="probes per depth (far, near)", windows=4)
    p.add_argument("--distractors", type=int, default=3, help="lookalike facts planted beside the asked one")
    p.add_argument("--seed", type=int, default=0, help="which facts and names are drawn")
    p.add_argument("--json", help="write the scan as JSON here (a file)")
    _trust_flag(p)
    p.set_defaults(func=_eval_restore_layers)

    p = ev.add_parser("needle", help="needle/distractor long-context capabilities, scored separately")
    p.add_argument("models", nargs="+", help="models (folders, sources or aliases) sharing one tokenizer")
    p.add_argument("--out", required=True, help="folder for needle.json, needle.md and heatmaps")
    p.add_argument("--lengths", default="1024,2048,4096", help="context lengths in tokens")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="relative insertion depths")
    p.add_argument("--per-cell", type=_positive_int, default=4, help="samples per capability x length x depth")
    p.add_argument("--categories", help="comma-separated subset of local,far,distractor,composition,order,repeated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text", default="python-docs:heldout", help="haystack text: file, folder or named corpus")
    p.add_argument("--no-chat-template", action="store_true", help="feed the raw prompt even if the tokenizer has a chat template")
    _prompt_style_flag(p)
    p.add_argument("--max-new-tokens", type=_positive_int, default=32)
    p.add_argument("--export-jsonl", help="also write the samples as JSONL (lm-eval task data)")
    _trust_flag(p)
    p.set_defaults(func=_eval_needle)

    p = ev.add_parser("report", help="one markdown report: ppl, needle capabilities and cost, original vs converted")
    p.add_argument("models", nargs="+", help="ORIGINAL CONVERTED [...]: the first is the reference")
    p.add_argument("--out", required=True)
    p.add_argument("--text", default="python-docs:heldout")
    p.add_argument("--window", type=_window_length, default=512)
    p.add_argument("--max-windows", type=_positive_int, default=8)
    p.add_argument("--needle-lengths", default="1024,2048")
    p.add_argument("--needle-depths", default="0,0.5,1")
    p.add_argument("--per-cell", type=_positive_int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-chat-template", action="store_true")
    _prompt_style_flag(p)
    p.add_argument("--bench-lengths", default="1024,2048")
    p.add_argument("--repeats", type=_positive_int, default=1)
    _trust_flag(p)
    p.set_defaults(func=_eval_report)

    p = ev.add_parser("lm", help="lm-eval tasks in-process (HFLM over the loaded model)")
    p.add_argument("model")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names (ours: hf_csa2_needle)")
    p.add_argument("--include_path", "--include-path", action="append", help="extra task folders (default: the repo's evals/)")
    p.add_argument("--metadata", help="JSON passed to the tasks, e.g. '{\"needle_jsonl\": \"samples.jsonl\"}'")
    p.add_argument("--limit", type=_limit, default=None, help="a fraction of each task (<= 1) or a number of examples")
    p.add_argument("--batch-size", type=_positive_int, default=1)
    p.add_argument("--apply-chat-template", action="store_true")
    p.add_argument("--json", help="write the results JSON here (a file)")
    _trust_flag(p)
    p.set_defaults(func=_eval_lm)

    p = sub.add_parser("bench", help="prefill / TTFT / decode / peak RSS / KV bytes, models interleaved in one process")
    p.add_argument("models", nargs="+", help="models (folders, sources or aliases); ratios are to the first")
    p.add_argument("--lengths", default="2048,4096,8192", help="prompt lengths in tokens")
    p.add_argument("--new-tokens", type=_positive_int, default=16, help="decode steps timed per measurement")
    p.add_argument("--repeats", type=_positive_int, default=3, help="medians over this many interleaved repeats")
    p.add_argument("--batch", type=_positive_int, default=1, help="concurrent sequences")
    p.add_argument("--json", help="write every run and the medians here (a file)")
    _trust_flag(p)
    p.set_defaults(func=_bench)

    p = sub.add_parser("inspect", help="per-layer attention kinds and measured KV-cache size")
    p.add_argument("model")
    p.add_argument("--tokens", type=_positive_int, default=16, help="prefill length for the live-cache measurement")
    p.add_argument("--context", type=_positive_int, help="also measure the live cache after a prefill of this many tokens "
                   "(windowed layers keep only their window, so the per-token cost depends on it)")
    p.add_argument("--json", action="store_true")
    _trust_flag(p)
    p.set_defaults(func=_inspect)

    p = sub.add_parser("plan", help="search the CSA2 layer plan (which layers are full) for a KV budget; writes a plan YAML")
    p.add_argument("source", help="source model (folder, GGUF, Hub ID or alias)")
    p.add_argument("--kv-budget", required=True,
                   help="KV elements per token at --context (e.g. 960) or a fraction of the source's (e.g. 1/12)")
    p.add_argument("--plan", required=True, help="base plan YAML (mla, csa2 and calibration sections); the search "
                   "keeps its settings and chooses csa2.layers")
    p.add_argument("--out", required=True, help="plan YAML to write (a file; never the base plan)")
    p.add_argument("--context", type=_positive_int, default=8192, help="context length at which the KV budget is counted")
    p.add_argument("--refresh", type=_positive_int, default=4, help="stale candidates re-scored per greedy step")
    p.add_argument("--part-windows", type=_positive_int, default=4,
                   help="calibration windows each per-layer part (reader, bias, o_proj) is fitted on during the search")
    p.add_argument("--swa-pass", action="store_true",
                   help="then try each reading layer of the chosen plan as swa (own window only; same KV) and keep it "
                        "where the calibration loss falls")
    p.add_argument("--retrieval-scan", action=argparse.BooleanOptionalAction, default=True,
                   help="first cut each layer of the source alone to the plan's window and re-ask the answer check's "
                        "far probes; layers whose cut loses --retrieval-drop of the far answers are retrieval layers, "
                        "never demoted to reuse (calibration loss does not see them)")
    p.add_argument("--retrieval-drop", type=float, default=0.5,
                   help="share of the source's far answers a layer's cut must lose to be a retrieval layer (0 < x <= 1)")
    p.add_argument("--retrieval-mode", choices=("lowrank", "full"), default="lowrank",
                   help="what the retrieval layers become: lowrank (own keys and values cached as codes of width "
                        "csa2.lowrank_key_rank / lowrank_value_rank; default) or full (MLA latent entries)")
    p.add_argument("--keep-full", default=None, help="comma-separated layers that stay full, beside the scan's")
    p.add_argument("--json", help="also write the trade-off curve as JSON")
    p.add_argument("--overwrite", action="store_true")
    _trust_flag(p)
    p.set_defaults(func=_plan)

    p = sub.add_parser("export", help="write a converted checkpoint in a stock transformers architecture")
    p.add_argument("model", help="hf_csa2 checkpoint folder")
    p.add_argument("--format", default="deepseek_v3", help="target format (allowed: deepseek_v3)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder that hf-csa2 wrote")
    _trust_flag(p)
    p.set_defaults(func=_export)

    p = sub.add_parser("push", help="validate a converted, exported or uplifted folder, write its model card and "
                                    "upload it to the Hugging Face Hub")
    p.add_argument("folder", help="checkpoint folder (convert/export output, train's merged/) or train's adapter/")
    p.add_argument("repo_id", help="Hub repository OWNER/NAME (created if missing)")
    p.add_argument("--private", action="store_true", help="create the repository private")
    p.add_argument("--revision", dest="hub_revision", help="branch to upload to (created if missing)")
    p.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing")
    p.add_argument("--commit-message")
    p.add_argument("--format", default="native", help="native, or deepseek_v3 (exported first; MLA checkpoints)")
    p.add_argument("--dry-run", action="store_true", help="validate, print the files, sizes and card; upload nothing")
    p.add_argument("--include", action="append", metavar="PATTERN",
                   help="also publish files matching PATTERN (glob on the relative path; pickles never)")
    _card_flags(p)
    p.set_defaults(func=_push)

    p = sub.add_parser("card", help="write only the model card (README.md) of a folder")
    p.add_argument("folder")
    p.add_argument("--repo-id", help="the repository the card names (default USER/<folder name>)")
    p.add_argument("--out", help="card file to write (default FOLDER/README.md)")
    _card_flags(p)
    p.set_defaults(func=_card)
    return parser


def _push_flags(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--push-to-hub", metavar="REPO_ID", help=f"then publish {what} as hf-csa2 push does (checked "
                                                            "before any work starts)")
    p.add_argument("--private", action="store_true", help="with --push-to-hub: create the repository private")
    p.add_argument("--license", help="with --push-to-hub: license identifier, when the source's is not recorded")
    p.add_argument("--base-model", help="with --push-to-hub: the source's Hub ID, when not recorded")
    p.set_defaults(eval=None)


def _card_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--license", help="license identifier, when the source's is not recorded (e.g. apache-2.0)")
    p.add_argument("--base-model", help="the base model's Hub ID, when not recorded (adapters: the converted "
                                        "checkpoint they adapt)")
    p.add_argument("--eval", action="append", metavar="RESULT.json",
                   help="results to state on the card: eval ppl --json, eval needle's needle.json, bench --json")


def main(argv: list[str] | None = None) -> int:
    """Run one command. Exit 0 on success, 2 for a user error (one line on stderr), 130 on
    Ctrl-C (one line; temp folders removed); anything else is a bug and keeps its traceback."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # argparse: --help (0) or a bad flag (2, one line already printed)
        return int(exit_.code or 0)
    args.argv = argv  # recorded in reports so they can be reproduced
    progress = logging.StreamHandler(sys.stderr)
    progress.setFormatter(logging.Formatter("%(message)s"))
    package_logger = logging.getLogger("hf_csa2")
    if not package_logger.handlers:
        package_logger.addHandler(progress)
    package_logger.setLevel(logging.INFO)
    try:
        return args.func(args)
    except UserError as err:
        print(f"hf-csa2: error: {one_line(err)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("hf-csa2: interrupted (unfinished checkpoint folders are removed; eval needle resumes from its journal)",
              file=sys.stderr)
        return EXIT_INTERRUPTED



if __name__ == "__main__":
    sys.exit(main())
