"""Max abs logit difference between an hf_csa2 MLA checkpoint and its DeepSeek-V3 export
(loaded by stock transformers, no remote code) on held-out windows, and greedy agreement.

    python scripts/check_export.py runs/smollm2-mla-quarter-dsv3 runs/smollm2-mla-quarter-dsv3-export [--windows 2] [--dtype float64]
"""

import argparse

import torch
from transformers import AutoModelForCausalLM

from hf_csa2.data.corpus import resolve_text
from hf_csa2.data.windows import token_windows
from hf_csa2.io.sources import load_source


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("converted")
    parser.add_argument("exported")
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"],
                        help="float64 separates the mapping's error from fp32 rounding that 30 layers amplify")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    ours = load_source(args.converted, check_supported=False, dtype=dtype)
    stock = AutoModelForCausalLM.from_pretrained(args.exported, dtype=dtype).eval()
    windows = token_windows(ours.tokenizer, resolve_text("python-docs:heldout"), 512, args.windows)
    diff = max((ours.model(w[None]).logits - stock(w[None]).logits).abs().max().item() for w in windows)
    prompt = windows[:1, :64]
    same = torch.equal(ours.model.generate(prompt, max_new_tokens=24, do_sample=False),
                       stock.generate(prompt, max_new_tokens=24, do_sample=False))
    print(f"class {type(stock).__name__} ({args.dtype}); max abs logit diff over {args.windows} x 512 held-out tokens: {diff:.3g}; "
          f"greedy (24 tokens) identical: {same}")


if __name__ == "__main__":
    main()
