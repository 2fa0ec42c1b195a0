"""Held-out ppl of SmolLM2 -> MQA (calibrated) for several refit ridges, and without refit.

    python scripts/sweep_gqa_ridge.py [--windows 6] [--ridges 0.001,0.01,0.1,0.3,1]

Same calibration windows as conversion/smollm2-mqa.yaml (python-docs:calib, 16 x 512 after
the 4 scoring windows); held-out = python-docs:heldout, first N windows of 512.
"""

import argparse

from hf_csa2.data.corpus import resolve_text
from hf_csa2.data.windows import token_windows
from hf_csa2.metrics.perplexity import mean_nll
from hf_csa2.surgery.gqa import apply_gqa
from hf_csa2.surgery.plan import GqaPlan
from hf_csa2.io.sources import load_source


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--windows", type=int, default=6)
    parser.add_argument("--ridges", default="0.001,0.01,0.1,0.3,1")
    args = parser.parse_args()
    src = load_source("smollm2-135m")
    calib = token_windows(src.tokenizer, resolve_text("python-docs:calib"), 512, 20)[4:]
    held = token_windows(src.tokenizer, resolve_text("python-docs:heldout"), 512, args.windows)
    base = mean_nll(src.model, held)["ppl"]
    rows = [("original", base)]
    no_refit, _ = apply_gqa(src.model, GqaPlan(num_key_value_heads=1, refit_output=False), windows=calib)
    rows.append(("calibrated, no refit", mean_nll(no_refit, held)["ppl"]))
    for ridge in [float(r) for r in args.ridges.split(",")]:
        model, _ = apply_gqa(src.model, GqaPlan(num_key_value_heads=1, ridge=ridge), windows=calib)
        rows.append((f"calibrated, refit ridge {ridge:g}", mean_nll(model, held)["ppl"]))
    print(f"| variant | held-out ppl ({args.windows} x 512) | ratio |\n|---|---:|---:|")
    for name, ppl in rows:
        print(f"| {name} | {ppl:.3f} | {ppl / base:.3f} |")


if __name__ == "__main__":
    main()
