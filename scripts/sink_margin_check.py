"""How far below the calibration logsumexp must sinks start for bit-identical logits?

    python scripts/sink_margin_check.py [--margins 20,24,28]

Calibrates SmolLM2 sinks on python-docs:calib (4 x 512 tokens, the preset's fit windows) and
compares logits with the source on 4 held-out windows of 512 (python-docs:heldout).
"""

import argparse

from hf_csa2.data.corpus import resolve_text
from hf_csa2.data.windows import token_windows
from hf_csa2.surgery.sinks import add_sinks, calibrate_sinks, min_logsumexp_per_head
from hf_csa2.io.sources import load_source


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--margins", default="20,24,28")
    args = parser.parse_args()
    src = load_source("smollm2-135m")
    calib = token_windows(src.tokenizer, resolve_text("python-docs:calib"), 512, 8)[4:]
    held = token_windows(src.tokenizer, resolve_text("python-docs:heldout"), 512, 4)
    model = add_sinks(src.model)
    lse_calib, lse_held = min_logsumexp_per_head(model, calib), min_logsumexp_per_head(model, held)
    drop = max((lse_calib[i] - lse_held[i]).max().item() for i in lse_calib)
    print(f"largest drop of a head's min logsumexp from calibration to held-out text: {drop:.2f} nats")
    reference = src.model(held).logits
    print("| margin | max abs logit diff vs source |\n|---:|---:|")
    for margin in [float(m) for m in args.margins.split(",")]:
        calibrate_sinks(model, calib, margin)
        print(f"| {margin:g} | {(model(held).logits - reference).abs().max().item():.3g} |")


if __name__ == "__main__":
    main()
