"""Time dense attention with sinks on CPU: the one fused call (gate from its logsumexp, used without
gradients), the two-call path (sink as a virtual key; used when gradients are wanted) and no sinks.

    python scripts/bench_sink_attention.py [--tokens 2048] [--heads 9] [--kv-heads 3] [--head-dim 64] [--repeats 3]
    python scripts/bench_sink_attention.py --decode [--tokens 4096] [--kv-heads 1]

Forward only, causal; prints the median of ``--repeats`` per path and the largest output difference.
With ``--decode`` one query position reads ``--tokens`` keys: without gradients that is the grouped
decode read (one matmul per KV head), next to the two-call path (keys repeated per query head) and
PyTorch's SDPA without sinks (``enable_gqa``, what a transformers source runs).
"""

import argparse
import statistics
import time

import torch

from hf_csa2.model.sink_attention import sdpa_sink_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode", action="store_true", help="one query position (a decode step)")
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    t, d = args.tokens, args.head_dim
    q = torch.randn(1, args.heads, 1 if args.decode else t, d, generator=g)
    k, v = (torch.randn(1, args.kv_heads, t, d, generator=g) for _ in range(2))
    sinks = torch.randn(args.heads, generator=g)
    wanting_grad = sinks.clone().requires_grad_(True)  # selects the two-call path; nothing is differentiated

    def one_call():
        with torch.no_grad():
            return sdpa_sink_attention(q, k, v, None, scaling=d**-0.5, sinks=sinks)[0]

    def two_calls():
        return sdpa_sink_attention(q, k, v, None, scaling=d**-0.5, sinks=wanting_grad)[0].detach()

    def no_sinks():
        with torch.no_grad():
            return sdpa_sink_attention(q, k, v, None, scaling=d**-0.5, sinks=None)[0]

    def source_sdpa():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=d**-0.5, enable_gqa=True)

    paths = [("one call", one_call), ("two calls", two_calls), ("no sinks", no_sinks)]
    if args.decode:
        paths = [("one call", one_call), ("two calls", two_calls), ("SDPA, no sinks", source_sdpa)]
    outputs = {}
    for name, fn in paths:
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            outputs[name] = fn()
            times.append(time.perf_counter() - start)
        label = "grouped decode read" if args.decode and name == "one call" else name
        print(f"{label}: {1000 * statistics.median(times):.3f} ms (median of {args.repeats})")
    print(f"max |one call - two calls| = {(outputs['one call'] - outputs['two calls']).abs().max():.2e}")


if __name__ == "__main__":
    main()
