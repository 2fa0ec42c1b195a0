"""Probe of end-to-end distillation (``hf_csa2.surgery.distill``) on a converted checkpoint:
train its attention parameters toward the source's next-token distributions on calibration
windows, then score the source, the checkpoint before and after on held-out text in one run.

    python scripts/probe_distill.py smollm2-135m runs/smollm2-mla-quarter --windows 48 --steps 100 --lr 1e-4
"""

import argparse
import time

import torch

from hf_csa2.data.windows import token_windows
from hf_csa2.metrics.perplexity import mean_nll
from hf_csa2.io.sources import load_source
from hf_csa2.surgery.distill import TRAINABLE, distill_to_source


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source")
    ap.add_argument("converted")
    ap.add_argument("--text", default="python-docs:calib")
    ap.add_argument("--windows", type=int, default=48, help="calibration windows (the last --holdout are held out)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--holdout", type=int, default=2)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--trainable", default="attention", choices=TRAINABLE)
    ap.add_argument("--heldout-text", default="python-docs:heldout")
    ap.add_argument("--heldout-windows", type=int, default=16)
    args = ap.parse_args()
    src = load_source(args.source)
    conv = load_source(args.converted)
    windows = token_windows(src.tokenizer, args.text, args.seq_len, args.windows)
    heldout = token_windows(src.tokenizer, args.heldout_text, 512, args.heldout_windows)
    base = mean_nll(src.model, heldout)["ppl"]
    before = mean_nll(conv.model, heldout)["ppl"]
    print(f"held-out ppl: source {base:.4f}, converted {before:.4f} (ratio {before / base:.4f})", flush=True)
    t0 = time.perf_counter()
    notes = distill_to_source(conv.model, src.model, windows, steps=args.steps, lr=args.lr, batch=args.batch,
                              holdout=args.holdout, every=args.every, trainable=args.trainable,
                              log=lambda m: print(m, flush=True))
    after = mean_nll(conv.model, heldout)["ppl"]
    print(f"{notes}; {time.perf_counter() - t0:.0f} s")
    print(f"held-out ppl: source {base:.4f}, before {before:.4f} ({before / base:.4f}), "
          f"after {after:.4f} ({after / base:.4f})")


if __name__ == "__main__":
    main()
