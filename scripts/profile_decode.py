"""Where a decode step's time goes: torch.profiler over a few decode steps of a model at a given
context and batch, ops ranked by their own CPU time (and by input shapes).

The cache is built cheaply: ONE prefill of batch 1, repeated over the batch
(``Cache.batch_repeat_interleave``), so a batch-8 profile at 4K costs one 4K prefill, not eight.
Every row then reads the same entries; a Top-K read of identical rows touches fewer distinct
store rows than a real batch does, so use ``hf-csa2 bench --batch N`` for the figures to quote and
this for where the time goes.

    python scripts/profile_decode.py runs/smollm2-csa2-searched --length 4096 --batch 8
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from hf_csa2.io.sources import load_source


def decode(model, cache, token, steps: int):
    for _ in range(steps):
        out = model(input_ids=token, cache=cache, use_cache=True)
        cache, token = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)
    return cache, token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a checkpoint folder or a built-in alias")
    parser.add_argument("--length", type=int, default=4096, help="prompt tokens before decoding")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="decode steps timed, then profiled")
    parser.add_argument("--rows", type=int, default=25, help="ops listed per table")
    args = parser.parse_args()

    model = load_source(args.model, check_supported=False).model.eval()
    ids = torch.randint(0, model.config.vocab_size, (1, args.length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        print(f"prefill (batch 1) {time.perf_counter() - t0:.1f} s", flush=True)
        cache = out.cache
        cache.batch_repeat_interleave(args.batch)
        token = out.logits[:, -1].argmax(-1, keepdim=True).repeat(args.batch, 1)
        cache, token = decode(model, cache, token, 2)  # warm-up
        t0 = time.perf_counter()
        cache, token = decode(model, cache, token, args.steps)
        print(f"decode {1000 * (time.perf_counter() - t0) / args.steps:.1f} ms/token (batch {args.batch}, "
              f"context {args.length}, not profiled)", flush=True)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            decode(model, cache, token, args.steps)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    print(prof.key_averages(group_by_input_shape=True).table(
        sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=30, max_shapes_column_width=100))


if __name__ == "__main__":
    main()
