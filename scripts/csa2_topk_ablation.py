"""How much of a CSA2 checkpoint's loss comes from the Top-K selection vs the entry readers:
held-out ppl as converted, and with every older entry selected (top_k = context length).

    python scripts/csa2_topk_ablation.py runs/smollm2-csa2 --window 2048 --max-windows 2
"""

import argparse

import torch

from hf_csa2.data.corpus import resolve_text
from hf_csa2.data.windows import token_windows
from hf_csa2.metrics.perplexity import mean_nll
from hf_csa2.io.sources import load_source


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="hf_csa2 checkpoint with CSA2 layers")
    parser.add_argument("--text", default="python-docs:heldout")
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--max-windows", type=int, default=2)
    args = parser.parse_args()
    loaded = load_source(args.model, check_supported=False)
    model = loaded.model.eval()
    x = token_windows(loaded.tokenizer, resolve_text(args.text), args.window, args.max_windows)
    selecting = [layer.self_attn for layer in model.model.layers if hasattr(layer.self_attn, "top_k")]
    if not selecting:
        raise SystemExit(f"{args.model} has no CSA2 layer with a Top-K selection")
    with torch.no_grad():
        as_converted = mean_nll(model, x)["ppl"]
        for attn in selecting:
            attn.top_k = args.window
        everything = mean_nll(model, x)["ppl"]
    print(f"| {args.model} | {x.shape[0]} x {args.window} | as converted {as_converted:.4f} | "
          f"every older entry selected {everything:.4f} |")


if __name__ == "__main__":
    main()
