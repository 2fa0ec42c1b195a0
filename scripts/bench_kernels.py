"""GPU benchmark of hf_csa2's Triton kernels against their torch references and dense SDPA
(issue "Kernels": run it when the `device` tool lends a GPU; never needed by the tests).

For each length T (tokens in the sequence):
  sparse read -- one segment, H query heads over one shared store, Top-K + window entries per
      query: the kernel vs the reference (`gather` path) vs dense causal SDPA over all T keys;
      forward and forward + backward.
  indexer -- scores + causal Top-K: the fused kernel vs torch (`select_top_k`, chunked); forward.
  decode -- one query position over T cached keys, sinks on: the kernel vs the torch reference
      (`grouped_decode_attention`) vs SDPA without sinks; GQA (9 query / 3 KV heads of 64) and
      absorbed MLA (9 heads reading one 97-wide key / 65-wide latent), batch 1 and 8.

Medians of --repeats after --warmup calls, timed with CUDA events; a case that runs out of
memory prints OOM. One process, cases interleaved per length.

    python scripts/bench_kernels.py [--lengths 8192,32768,65536] [--json runs/bench_kernels.json]
    TRITON_INTERPRET=1 python scripts/bench_kernels.py --smoke     # tiny sizes on CPU: the script runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F


def timed(fn, repeats: int, warmup: int, device: str) -> float | str:
    """Median seconds of ``fn()``, or "OOM"."""
    try:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return "OOM"


def causal_index(b: int, t: int, top_k: int, window: int, device) -> torch.Tensor:
    """[B, T, top_k + window]: random earlier positions outside the window, then the window (-1 where
    a position does not exist yet)."""
    pos = torch.arange(t, device=device)[:, None]
    far = (torch.rand(b, t, top_k, device=device) * (pos - window).clamp(min=0)).long()
    far = torch.where(pos - window > 0, far, torch.full_like(far, -1))
    near = pos - torch.arange(window, device=device)[None, :]
    near = torch.where(near >= 0, near, torch.full_like(near, -1)).expand(b, t, window)
    return torch.cat([far, near], dim=-1)


def sparse_cases(t, args, device):
    from hf_csa2.kernels.sparse_read import sparse_sink_attention as kernel
    from hf_csa2.model.sparse_attention import SparseSegment, sparse_sink_attention as reference

    h, d = args.heads, args.head_dim
    q = torch.randn(1, t, h, d, device=device, dtype=args.dtype, requires_grad=True)
    kv = torch.randn(1, t, 1, d, device=device, dtype=args.dtype, requires_grad=True)
    sinks = torch.zeros(h, device=device, requires_grad=True)
    index = causal_index(1, t, args.top_k, args.window, device)
    seg = [SparseSegment(q, kv, kv, index)]
    qd, kd = q.detach().transpose(1, 2), kv.detach().transpose(1, 2).expand(1, h, t, d)

    def run(fn, backward):
        def call():
            out = fn()
            if backward:
                out.float().sum().backward()
        return call

    rows = {}
    for backward in (False, True):
        ctx = torch.enable_grad if backward else torch.no_grad
        with ctx():
            tag = "fwd+bwd" if backward else "fwd"
            rows[f"sparse read {tag}: kernel"] = timed(
                run(lambda: kernel(seg, scaling=d ** -0.5, sinks=sinks)[0][0], backward), args.repeats, args.warmup, device)
            rows[f"sparse read {tag}: reference (gather)"] = timed(
                run(lambda: reference(seg, scaling=d ** -0.5, sinks=sinks, path="gather")[0][0], backward),
                args.repeats, args.warmup, device)
            qs = qd.clone().requires_grad_(backward)
            rows[f"sparse read {tag}: dense SDPA, all keys"] = timed(
                run(lambda: F.scaled_dot_product_attention(qs, kd, kd, is_causal=True), backward),
                args.repeats, args.warmup, device)
    return rows


def indexer_cases(t, args, device):
    from hf_csa2.kernels.indexer import fused_select_top_k, masked_index_scores
    from hf_csa2.model.indexer import select_top_k

    n, d = 4, 64
    q = torch.randn(1, t, n, d, device=device) / d ** 0.5
    w = torch.randn(1, t, n, device=device)
    k = torch.randn(1, t, d, device=device)
    pos = torch.arange(t, device=device)
    with torch.no_grad():
        return {
            "indexer select: fused kernel": timed(lambda: fused_select_top_k(q, w, k, pos, args.top_k, args.window),
                                                  args.repeats, args.warmup, device),
            "indexer select: kernel scores + torch top-k": timed(
                lambda: select_top_k(q, w, k, pos, args.top_k, args.window, scores=masked_index_scores),
                args.repeats, args.warmup, device),
            "indexer select: torch": timed(lambda: select_top_k(q, w, k, pos, args.top_k, args.window),
                                           args.repeats, args.warmup, device),
        }


def decode_cases(t, args, device):
    from hf_csa2.kernels.decode import decode_sink_attention
    from hf_csa2.model.sink_attention import grouped_decode_attention

    rows = {}
    for batch in (1, 8):
        for name, hq, h, dk, dv in (("GQA 9/3 x 64", 9, 3, 64, 64), ("MLA absorbed 9 x 97/65", 9, 1, 97, 65)):
            q = torch.randn(batch, hq, 1, dk, device=device, dtype=args.dtype)
            k = torch.randn(batch, h, t, dk, device=device, dtype=args.dtype)
            v = torch.randn(batch, h, t, dv, device=device, dtype=args.dtype)
            sinks = torch.zeros(hq, device=device)
            tag = f"decode {name}, batch {batch}"
            with torch.no_grad():
                rows[f"{tag}: kernel"] = timed(lambda: decode_sink_attention(q, k, v, None, scaling=0.1, sinks=sinks),
                                               args.repeats, args.warmup, device)
                rows[f"{tag}: reference"] = timed(
                    lambda: grouped_decode_attention(q, k, v, None, scaling=0.1, sinks=sinks), args.repeats,
                    args.warmup, device)
                if dk == dv:
                    ke, ve = k.repeat_interleave(hq // h, 1), v.repeat_interleave(hq // h, 1)
                    rows[f"{tag}: SDPA, no sinks"] = timed(
                        lambda: F.scaled_dot_product_attention(q, ke, ve), args.repeats, args.warmup, device)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="8192,32768,65536")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--top-k", type=int, default=256)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="bfloat16")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat: checks the script runs (CPU interpreter)")
    p.add_argument("--json", help="also write the table as JSON here")
    args = p.parse_args()
    if args.smoke:
        args.lengths, args.repeats, args.warmup, args.top_k, args.window, args.dtype = "80", 1, 0, 16, 16, "float32"
    args.dtype = getattr(torch, args.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    table = {}
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu (Triton interpreter)'}, "
          f"dtype {args.dtype}, top-k {args.top_k}, window {args.window}")
    print("| tokens | case | seconds (median) |")
    print("|---:|---|---:|")
    for t in (int(x) for x in args.lengths.split(",")):
        for cases in (sparse_cases, indexer_cases, decode_cases):
            for name, value in cases(t, args, device).items():
                table.setdefault(str(t), {})[name] = value
                shown = value if isinstance(value, str) else f"{value:.5f}"
                print(f"| {t} | {name} | {shown} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
