"""In-process lm-eval: HFLM over a model loaded by hf-csa2 (any source or converted folder).

Our own task YAMLs live in the repository's ``evals/`` folder (``--include_path``); any other
lm-eval task works too.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

from ..errors import InputError

REPO_EVALS = Path(__file__).resolve().parents[2] / "evals"


def _lm_eval():
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise InputError("hf-csa2 eval lm needs lm-eval: pip install 'hf-csa2[eval]'") from None
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    return simple_evaluate, HFLM, TaskManager


def task_manager(include_paths: list[str] | None = None, metadata: dict | None = None):
    """lm-eval's TaskManager over its own tasks plus ours (the repository's ``evals/``)."""
    _, _, TaskManager = _lm_eval()
    paths = list(include_paths or [])
    if not paths and REPO_EVALS.is_dir():
        paths = [str(REPO_EVALS)]
    return TaskManager(include_path=paths or None, metadata=metadata)


def check_tasks(tasks: list[str], manager) -> None:
    """Refuse unknown task names before any model is loaded."""
    known = set(manager.all_tasks)
    unknown = [t for t in tasks if t not in known and not fnmatch.filter(known, t)]
    if unknown:
        ours = sorted(t for t in known if t.startswith("hf_csa2"))
        raise InputError(f"--tasks {','.join(unknown)}: no such lm-eval task, group or tag; ours: {', '.join(ours)} "
                         "(`lm-eval ls tasks` lists the others; --include-path adds task folders)")


def run_lm_eval(model, tokenizer, tasks: list[str], *, include_paths: list[str] | None = None,
                metadata: dict | None = None, limit: float | None = None, batch_size: int = 1,
                apply_chat_template: bool = False, max_length: int | None = None, manager=None) -> dict:
    """Run lm-eval's ``simple_evaluate`` on an already-loaded model; returns its results dict."""
    simple_evaluate, HFLM, _ = _lm_eval()
    manager = manager or task_manager(include_paths, metadata)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length)
    return simple_evaluate(
        model=lm, tasks=tasks, task_manager=manager, metadata=metadata,
        limit=limit, apply_chat_template=apply_chat_template, log_samples=False,
    )


def summarise(results: dict) -> str:
    from lm_eval.utils import make_table

    return make_table(results)


def write_results(results: dict, path: str | Path) -> None:
    """The ``results``/``versions``/``config`` parts as JSON (drops non-serialisable objects)."""
    keep = {k: results.get(k) for k in ("results", "versions", "n-shot", "higher_is_better")}
    Path(path).write_text(json.dumps(keep, indent=2, default=str))


__all__ = ["check_tasks", "run_lm_eval", "summarise", "task_manager", "write_results"]
