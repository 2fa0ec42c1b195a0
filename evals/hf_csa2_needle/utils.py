"""lm-eval glue for the hf-csa2 needle task: load our JSONL samples, score with our scorer."""

from __future__ import annotations

import math

from hf_csa2.evals.needle import CATEGORIES, NeedleSample, read_jsonl, score_output

ABSENT = -1.0  # a capability not present in a doc; ignored by mean_of_present


def load_needle(needle_jsonl: str | None = None, **_metadata):
    """custom_dataset hook: ``--metadata '{"needle_jsonl": PATH}'`` names the samples file."""
    import datasets

    if not needle_jsonl:
        raise ValueError(
            "hf_csa2_needle needs its samples: pass --metadata '{\"needle_jsonl\": \"PATH\"}' with a file written "
            "by `hf-csa2 eval needle ... --export-jsonl PATH`"
        )
    rows = [vars(s) for s in read_jsonl(needle_jsonl)]
    return {"test": datasets.Dataset.from_list(rows)}


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    fields = {k: doc[k] for k in NeedleSample.__dataclass_fields__ if k in doc}  # older exports lack style
    correct = float(score_output(NeedleSample(**fields), results[0]))
    out = {"acc": correct}
    for category in CATEGORIES:
        out[f"acc_{category}"] = correct if doc["category"] == category else ABSENT
    return out


def mean_of_present(values: list[float]) -> float:
    present = [v for v in values if v != ABSENT]
    return sum(present) / len(present) if present else math.nan
