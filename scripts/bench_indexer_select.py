"""Indexer Top-K selection over a whole prefill: the integer-key ``topk`` the indexer uses vs the
stable descending sort it replaced (same indices; checked here too). One process, interleaved,
medians; prints the ratio per length.

    python scripts/bench_indexer_select.py [--lengths 2048,4096] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import hf_csa2.model.indexer as indexer_module
from hf_csa2.model.indexer import Indexer, top_k_earliest_first


def stable_sort_top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    return scores.sort(dim=-1, descending=True, stable=True).indices[..., :k]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--lengths", default="2048,4096")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--top-k", type=int, default=256)
    p.add_argument("--window", type=int, default=128)
    args = p.parse_args()
    torch.manual_seed(0)
    idx = Indexer(576, 4, 64, [], rotary_dim=64, with_key=True)  # SmolLM2-135M width, 4 index heads of 64
    print("| prefill tokens | stable sort s | integer topk s | ratio | same picks |")
    print("|---:|---:|---:|---:|---|")
    for length in (int(x) for x in args.lengths.split(",")):
        h = torch.randn(1, length, 576)
        with torch.no_grad():
            q, w = idx.queries(h, None)
            keys = idx.keys(h, None)
            positions = torch.arange(length)
            times = {"sort": [], "topk": []}
            picks = {}
            for _ in range(args.repeats):
                for name, fn in (("sort", stable_sort_top_k), ("topk", top_k_earliest_first)):
                    indexer_module.top_k_earliest_first = fn
                    t0 = time.perf_counter()
                    picks[name] = idx.select(q, w, keys, positions, args.top_k, args.window)
                    times[name].append(time.perf_counter() - t0)
            indexer_module.top_k_earliest_first = top_k_earliest_first
        a, b = statistics.median(times["sort"]), statistics.median(times["topk"])
        print(f"| {length} | {a:.3f} | {b:.3f} | {b / a:.3f} | {torch.equal(picks['sort'], picks['topk'])} |")


if __name__ == "__main__":
    main()
