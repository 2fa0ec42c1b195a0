"""The measured figures a model card may state, each taken from a report file with the command
that reproduces it: the conversion's stage report (``conversion_report.json``), an uplift run's
``training_report.json``, and result files of ``hf-csa2 eval ppl --json`` / ``eval needle`` /
``bench --json`` given with ``--eval``. Nothing here measures anything: a number that no
report holds is not on the card.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from ..io.output import OUTPUT_MARKER
from .provenance import read_json

#: Decimal places figures are stated with (the card and its metadata carry the same value).
DIGITS = 4
TRAINING_REPORT = "training_report.json"


class EvidenceError(UserError, ValueError):
    """An ``--eval`` file that is not a result file of hf-csa2, or that does not measure the folder."""


@dataclass
class Figure:
    """One stated number: ``metric`` (a short identifier) of the folder's model on ``dataset``,
    ``value`` as stated, what it is (``label``), the file it came from and the command that
    measured it (None when the file does not record one)."""

    metric: str
    value: float | int
    dataset: str
    label: str
    origin: str
    command: str | None
    count: str | None = None  # "answered/asked" for accuracies


def _round(x: float) -> float:
    return round(float(x), DIGITS)


def stage_figures(folder: Path, report: dict) -> list[Figure]:
    """Figures of the conversion's stage report: the last stage against the ``source`` stage."""
    stages = report.get("stages") or []
    if len(stages) < 2:
        return []
    source, last = stages[0], stages[-1]
    calib = (report.get("plan") or {}).get("calibration") or {}
    text = calib.get("text", "calibration text")
    command = f"hf-csa2 convert {report.get('source')} --plan hf_csa2_plan.yaml --out {folder.name}"
    out = [Figure("ppl_ratio", _round(last["calib_ppl"] / source["calib_ppl"]), f"{text} (scoring windows)",
                  f"perplexity ratio to the source after stage `{last['stage']}` (the conversion, before any uplift)",
                  OUTPUT_MARKER, command),
           Figure("kv_elements_per_token", _round(last["kv_elements_per_token"]), "live cache",
                  "KV-cache elements per token" + (f" at {last['kv_context']} tokens of context" if last.get("kv_context")
                                                   else ""), OUTPUT_MARKER, command),
           Figure("kv_elements_per_token_source", _round(source["kv_elements_per_token"]), "live cache",
                  "the source's KV-cache elements per token, same context", OUTPUT_MARKER, command)]
    for row, who in ((last, "converted"), (source, "source")):
        check = row.get("answer_check")
        if check:
            for depth in ("far", "near"):
                out.append(Figure(f"answer_check_{depth}" + ("_source" if who == "source" else ""),
                                  _round(check[depth] / check["per_depth"]), f"{text} (answer-check probes)",
                                  f"{who}: facts planted {depth} in a {check['context']}-token prompt answered "
                                  f"({check[depth]}/{check['per_depth']})", OUTPUT_MARKER, command,
                                  f"{check[depth]}/{check['per_depth']}"))
    return out


_EVAL_KEY = re.compile(r"eval_(.+)_(ppl_ratio|kl|answers_far|answers_near)$")


def training_figures(training: dict, answers_per_depth: int | None = None) -> list[Figure]:
    """Figures of an uplift run's last held-out evaluation (``training_report.json``)."""
    evals = [h for h in training.get("history") or [] if any(_EVAL_KEY.match(k) for k in h)]
    if not evals:
        return []
    last = evals[-1]
    out = training.get("out", "OUT")
    command = f"hf-csa2 train {out}/recipe.yaml --out {out}"  # the run's own copy of its recipe
    per_depth = ((training.get("recipe") or {}).get("eval") or {}).get("answers")
    out = []
    for key, value in last.items():
        match = _EVAL_KEY.match(key)
        if not match:
            continue
        text, what = match.groups()
        if what.startswith("answers") and per_depth:
            depth = what.removeprefix("answers_")
            out.append(Figure(f"uplift_answers_{depth}", _round(value / per_depth), text,
                              f"after uplift (step {last['step']}): facts planted {depth} answered ({value}/{per_depth})",
                              TRAINING_REPORT, command))
        elif what in ("ppl_ratio", "kl"):
            label = "perplexity ratio to the teacher" if what == "ppl_ratio" else "KL(teacher || model) per token"
            out.append(Figure(f"uplift_{what}", _round(value), text, f"{label} after uplift (step {last['step']})",
                              TRAINING_REPORT, command))
    return out


def _same_model(name: str, folder: Path) -> bool:
    path = Path(name).expanduser()
    return (path.exists() and path.resolve() == folder.resolve()) or name == folder.name


def _row_of(names: list[str], folder: Path, path: Path) -> str:
    hits = [n for n in names if _same_model(n, folder)]
    if not hits:
        raise EvidenceError(f"--eval {path}: no model in it is {folder} (models: {', '.join(names)}); give a result "
                            "file that measured this folder")
    return hits[0]


def eval_file_figures(path: Path, folder: Path) -> list[Figure]:
    """Figures for ``folder`` in a result file of ``eval ppl --json``, ``eval needle``
    (needle.json) or ``bench --json``, each relative to the file's first (reference) model."""
    data = read_json(path)
    command = data.get("command") or (data.get("settings") or {}).get("command")
    if "results" in data and isinstance(data["results"], list):  # eval ppl --json
        rows = {r["model"]: r for r in data["results"]}
        name = _row_of(list(rows), folder, path)
        where = f"{data.get('text')} ({data.get('max_windows')} x {data.get('window')} tokens)"
        return [Figure("ppl_ratio", _round(rows[name]["ratio"]), data.get("text", "text"),
                       f"perplexity ratio to `{data['results'][0]['model']}` on {where}", path.name, command)]
    if "results" in data and isinstance(data["results"], dict):  # needle.json
        name = _row_of(list(data["results"]), folder, path)
        cells: dict[tuple[str, int], list[bool]] = defaultdict(list)
        for record in data["results"][name]:
            cells[(record["category"], record["target_length"])].append(bool(record["correct"]))
        return [Figure(f"needle_{category}_{length}", _round(sum(v) / len(v)), data["settings"].get("text", "text"),
                       f"needle `{category}` at {length} tokens ({sum(v)}/{len(v)} answered)", path.name, command)
                for (category, length), v in sorted(cells.items())]
    if "rows" in data:  # bench --json
        rows = data["rows"]
        name = _row_of(list(dict.fromkeys(r["model"] for r in rows)), folder, path)
        out = []
        for row in rows:
            if row["model"] != name:
                continue
            for key, label in (("decode_ms_per_token_ratio", "decode time per token"), ("prefill_s_ratio", "prefill time"),
                               ("kv_bytes_ratio", "KV-cache bytes"), ("peak_rss_mb_ratio", "peak RSS")):
                if row.get(key) is not None:
                    out.append(Figure(f"{key.removesuffix('_ratio')}_ratio_{row['length']}", _round(row[key]),
                                      f"bench (batch {row['batch']}, {row['dtype']})",
                                      f"{label} at {row['length']} tokens, ratio to `{rows[0]['model']}`", path.name,
                                      command))
        return out
    raise EvidenceError(f"--eval {path}: not a result file of `hf-csa2 eval ppl --json`, `eval needle` "
                        "(needle.json) or `bench --json`")


def folder_figures(folder: Path, eval_files: list[Path] = ()) -> tuple[list[Figure], dict, dict | None]:
    """Every figure for ``folder``: its stage report, the uplift run it came out of (a
    ``training_report.json`` in the folder or beside it: ``train``'s ``merged/`` and ``adapter/``),
    and ``eval_files``. Returns (figures, conversion report, training report or None)."""
    report = read_json(folder / OUTPUT_MARKER)
    figures = stage_figures(folder, report)
    training = None
    for candidate in (folder / TRAINING_REPORT, folder.parent / TRAINING_REPORT):
        if candidate.is_file():
            training = {**read_json(candidate), "out": folder.parent.name if candidate.parent != folder else folder.name}
            figures += training_figures(training)
            break
    for path in eval_files:
        figures += eval_file_figures(Path(path), folder)
    return figures, report, training


__all__ = ["DIGITS", "EvidenceError", "Figure", "eval_file_figures", "folder_figures", "stage_figures",
           "training_figures"]
