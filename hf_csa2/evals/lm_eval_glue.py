"""In-process lm-eval: HFLM over a model loaded by hf-csa2 (any source or converted folder).

Our own task YAMLs live in the repository's ``evals/`` folder (``--include_path``); any other
lm-eval task works too.
"""

from __future__ import annotations

import json
from pathlib import Path

REPO_EVALS = Path(__file__).resolve().parents[2] / "evals"


def run_lm_eval(model, tokenizer, tasks: list[str], *, include_paths: list[str] | None = None,
                metadata: dict | None = None, limit: float | None = None, batch_size: int = 1,
                apply_chat_template: bool = False, max_length: int | None = None) -> dict:
    """Run lm-eval's ``simple_evaluate`` on an already-loaded model; returns its results dict."""
    try:
        from lm_eval import simple_evaluate
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as err:
        raise ImportError("hf-csa2 eval lm needs lm-eval: pip install 'hf-csa2[eval]'") from err
    paths = list(include_paths or [])
    if not paths and REPO_EVALS.is_dir():
        paths = [str(REPO_EVALS)]
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length)
    return simple_evaluate(
        model=lm, tasks=tasks, task_manager=TaskManager(include_path=paths or None, metadata=metadata), metadata=metadata,
        limit=limit, apply_chat_template=apply_chat_template, log_samples=False,
    )


def summarise(results: dict) -> str:
    from lm_eval.utils import make_table

    return make_table(results)


def write_results(results: dict, path: str | Path) -> None:
    """The ``results``/``versions``/``config`` parts as JSON (drops non-serialisable objects)."""
    keep = {k: results.get(k) for k in ("results", "versions", "n-shot", "higher_is_better")}
    Path(path).write_text(json.dumps(keep, indent=2, default=str))


__all__ = ["run_lm_eval", "summarise", "write_results"]
