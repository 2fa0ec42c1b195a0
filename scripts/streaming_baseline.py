"""The window + attention-sink baseline (StreamingLLM) for a KV budget: held-out ppl of the
ORIGINAL model when every layer attends only to its last W tokens plus the first P tokens
(an explicit attention mask; nothing is converted), next to full attention, on the same
token windows as ``hf-csa2 eval ppl``. Its cache would hold W-1+P tokens per layer.

    python scripts/streaming_baseline.py smollm2-135m --window 2048 --max-windows 2 --patterns 128+0,128+4,256+4,512+4
"""

import argparse

import torch

from hf_csa2.data.corpus import resolve_text
from hf_csa2.metrics.kv_cache import config_kv_elements_at_context
from hf_csa2.data.windows import token_windows
from hf_csa2.io.sources import load_source


@torch.no_grad()
def masked_ppl(model, windows: torch.Tensor, window: int | None, sink_tokens: int) -> float:
    """ppl over windows [N, T] with attention restricted to the last ``window`` tokens plus the
    first ``sink_tokens`` (``window=None``: plain causal attention)."""
    t = windows.shape[1]
    mask = None
    if window is not None:
        i = torch.arange(t)
        allow = (i[None, :] <= i[:, None]) & ((i[:, None] - i[None, :] < window) | (i[None, :] < sink_tokens))
        mask = torch.zeros(t, t).masked_fill(~allow, float("-inf"))[None, None]
    total, count = 0.0, 0
    for row in windows:
        logits = model(input_ids=row[None], attention_mask=mask, use_cache=False).logits[0, :-1].float()
        total -= torch.log_softmax(logits, -1).gather(-1, row[1:, None]).sum().item()
        count += t - 1
    return float(torch.exp(torch.tensor(total / count)))


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
    model = loaded.model.eval()
    model.config._attn_implementation = "eager"  # an explicit float mask, same on every backend
    x = token_windows(loaded.tokenizer, resolve_text(args.text), args.window, args.max_windows)
    full_kv = config_kv_elements_at_context(model.config, args.context) / args.context
    base = masked_ppl(model, x, None, 0)
    print(f"| pattern | KV elements/token @{args.context} | ppl ({x.shape[0]} x {args.window}) | ratio |")
    print("|---|---:|---:|---:|")
    print(f"| full attention | {full_kv:.1f} | {base:.4f} | 1.000 |")
    for pattern in args.patterns.split(","):
        w, p = (int(v) for v in pattern.split("+"))
        kv = full_kv * min(args.context, w - 1 + p) / args.context
        ppl = masked_ppl(model, x, w, p)
        print(f"| window {w} + first {p} | {kv:.1f} | {ppl:.4f} | {ppl / base:.3f} |", flush=True)


if __name__ == "__main__":
    main()
