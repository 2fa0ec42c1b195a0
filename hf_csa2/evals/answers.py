"""The answer check (:mod:`hf_csa2.metrics.answer_check`) for several models on identical probes:
facts planted far back (5 % into a window of real text) and near the end, asked back; a probe is
answered when greedy decoding would print the answer (teacher-forced exact match).

    hf-csa2 eval answers SOURCE CONVERTED [...] --text fortunes:heldout --context 2048 --per-depth 20

Probes are cut from the first ``per_depth`` windows of ``text`` with the first model's tokenizer;
every model must share it. Models are loaded one at a time.
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Iterable
from pathlib import Path

from ..data.windows import token_windows
from ..errors import InputError
from ..metrics.answer_check import answer_check, make_probes
from .ppl import ModelEntry, _materialise


def compare_answers(models: Iterable[ModelEntry], text: str | os.PathLike, *, context: int = 512, per_depth: int = 20,
                    seed: int = 0) -> list[dict]:
    """One dict per model: ``model``, ``far``, ``near`` (answered of ``per_depth``), ``per_depth``,
    ``answer_nll`` (mean NLL of the answer tokens, nats), ``context``."""
    probes, vocab, results = None, None, []
    for entry in models:
        name, model, tokenizer = _materialise(entry)
        if probes is None:
            filler = token_windows(tokenizer, text, window=context, max_windows=per_depth)
            try:
                probes, vocab = make_probes(tokenizer, filler, per_depth, seed=seed), tokenizer.get_vocab()
            except ValueError as err:
                raise InputError(f"--context {context}: {err}") from None
        elif tokenizer.get_vocab() != vocab:
            raise InputError(f"{name}: its tokenizer differs from the first model's; the probes are the same token ids "
                             "for every model, so all must share one tokenizer")
        results.append({"model": name, **answer_check(model, probes).to_dict()})
        del model
        gc.collect()
    return results


def format_answers_table(results: list[dict]) -> str:
    """Markdown table ``model | far | near | answer NLL``."""
    lines = ["| model | far | near | answer NLL |", "|---|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['model']} | {r['far']}/{r['per_depth']} | {r['near']}/{r['per_depth']} | "
                     f"{r['answer_nll']:.3f} |")
    return "\n".join(lines)


def write_answers_json(results: list[dict], path: str | os.PathLike, *, text: str, seed: int = 0) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"results": results, "text": str(text), "seed": seed}, indent=2))


__all__ = ["compare_answers", "format_answers_table", "write_answers_json"]
