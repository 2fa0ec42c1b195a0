"""Held-out ppl of SmolLM2 -> MLA for several (rope pairs, rank) splits of a KV budget,
RoPE criteria and factorisations, all in one process against the original.

    python scripts/sweep_mla.py --budget 192 --pairs 2,4,8 [--shared] [--full-rank] [--criteria perturbation,norm]
        [--factorisations activation_aware,weight_svd] [--windows 6] [--no-refit]

Budget = cache elements per token per layer = kv_lora_rank + KV heads * 2 * pairs
(kv_lora_rank + 2 * pairs with --shared).
Calibration: python-docs:calib, 16 x 512 after the 4 scoring windows (as the presets);
held-out: python-docs:heldout, first N windows of 512.
"""

import argparse
import time

from hf_csa2.data.corpus import resolve_text
from hf_csa2.data.windows import token_windows
from hf_csa2.metrics.perplexity import mean_nll
from hf_csa2.surgery.mla import apply_mla, full_stack_width
from hf_csa2.surgery.plan import MlaPlan
from hf_csa2.io.sources import load_source


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=int, default=192)
    parser.add_argument("--pairs", default="2,4,8")
    parser.add_argument("--criteria", default="perturbation,norm")
    parser.add_argument("--factorisations", default="activation_aware,weight_svd")
    parser.add_argument("--windows", type=int, default=6)
    parser.add_argument("--no-refit", action="store_true")
    parser.add_argument("--source", default="smollm2-135m")
    parser.add_argument("--shared", action="store_true", help="one rope key mixing the KV heads (n slots in total)")
    parser.add_argument("--full-rank", action="store_true",
                        help="latent at the exact rank (ignores --budget): isolates what the RoPE split costs")
    args = parser.parse_args()
    src = load_source(args.source)
    kv = src.model.config.num_key_value_heads
    calib = token_windows(src.tokenizer, resolve_text("python-docs:calib"), 512, 20)[4:]
    held = token_windows(src.tokenizer, resolve_text("python-docs:heldout"), 512, args.windows)
    base = mean_nll(src.model, held)["ppl"]
    print(f"| variant | held-out ppl ({args.windows} x 512) | ratio | seconds |\n|---|---:|---:|---:|")
    print(f"| original | {base:.3f} | 1.000 | |", flush=True)
    for pairs in [int(p) for p in args.pairs.split(",")]:
        rank = args.budget - (1 if args.shared else kv) * 2 * pairs
        if args.full_rank:
            rank = full_stack_width(src.model.config, kv, pairs, args.shared)
        for criterion in args.criteria.split(","):
            for fact in args.factorisations.split(","):
                t = time.perf_counter()
                plan = MlaPlan(kv_lora_rank=rank, qk_rope_head_dim=2 * pairs, rope_key="shared" if args.shared else "per_head",
                               rope_criterion=criterion, init=fact, refit_output=not args.no_refit)
                model, _ = apply_mla(src.model, plan, windows=calib)
                ppl = mean_nll(model, held)["ppl"]
                name = f"n={pairs} r={rank} {criterion} {fact}"
                print(f"| {name} | {ppl:.3f} | {ppl / base:.3f} | {time.perf_counter() - t:.0f} |", flush=True)


if __name__ == "__main__":
    main()
