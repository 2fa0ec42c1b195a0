"""The window + attention-sink baseline (StreamingLLM) for several KV budgets in one table: held-out
ppl of the ORIGINAL model when every layer attends only to its last W tokens plus the first P
(``window:W+P:SOURCE``, :mod:`hf_csa2.evals.window_baseline`; nothing is fitted), next to full
attention, on the same token windows as ``hf-csa2 eval ppl``, with each row's KV elements per token.
One pattern is also ``hf-csa2 eval ppl SOURCE window:W+P:SOURCE``.

    python scripts/streaming_baseline.py smollm2-135m --window 2048 --max-windows 2 --patterns 128+0,128+4,256+4,512+4
"""

import argparse
import math

from hf_csa2.data.corpus import resolve_text
from hf_csa2.data.windows import token_windows
from hf_csa2.evals.window_baseline import window_model
from hf_csa2.io.sources import load_source
from hf_csa2.metrics.kv_cache import config_kv_elements_at_context
from hf_csa2.metrics.perplexity import mean_nll


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--text", default="python-docs:heldout")
    parser.add_argument("--window", type=int, default=2048, help="evaluation window (tokens)")
    parser.add_argument("--max-windows", type=int, default=2)
    parser.add_argument("--patterns", default="128+4", help="comma-separated W+P (attention window + sink tokens)")
    parser.add_argument("--context", type=int, default=8192, help="context at which KV elements/token are counted")
    args = parser.parse_args()
    loaded = load_source(args.model)
    x = token_windows(loaded.tokenizer, resolve_text(args.text), args.window, args.max_windows)
    full_kv = config_kv_elements_at_context(loaded.model.config, args.context) / args.context
    base = math.exp(mean_nll(loaded.model, x)["nll"])
    print(f"| pattern | KV elements/token @{args.context} | ppl ({x.shape[0]} x {args.window}) | ratio |")
    print("|---|---:|---:|---:|")
    print(f"| full attention | {full_kv:.1f} | {base:.4f} | 1.000 |")
    for pattern in args.patterns.split(","):
        w, p = (int(v) for v in pattern.split("+"))
        model = window_model(loaded.model, w, p)
        kv = config_kv_elements_at_context(model.config, args.context) / args.context
        ppl = math.exp(mean_nll(model, x)["nll"])
        print(f"| window {w} + first {p} | {kv:.1f} | {ppl:.4f} | {ppl / base:.3f} |", flush=True)


if __name__ == "__main__":
    main()
