"""Real-checkpoint numbers behind the MLA acceptance checks, printed rather than asserted:
full-rank exactness of a source (explicit and absorbed paths), explicit vs absorbed on a converted
MLA checkpoint (logits and greedy text), and its KV elements per token from the live cache.

    python scripts/check_mla_paths.py smollm2-135m runs/smollm2-mla-quarter-d128k [--windows 2]

The tests (tests/test_real_smollm2.py) assert the same properties on shorter inputs.
"""

import argparse

import torch

from hf_csa2.data.corpus import resolve_text
from hf_csa2.metrics.kv_cache import measure_kv_elements_per_token
from hf_csa2.data.windows import token_windows
from hf_csa2.model.configuration_hf_csa2 import attention_head_dim
from hf_csa2.surgery.mla import apply_mla, full_stack_width
from hf_csa2.surgery.plan import MlaPlan
from hf_csa2.io.sources import load_source


def on_each_path(model, run) -> dict:
    """``{path: run()}`` with the model switched to each attention path in turn, then back to auto."""
    out = {}
    for path in ("explicit", "absorbed"):
        model.config.mla_attention_path = path
        out[path] = run()
    model.config.mla_attention_path = "auto"
    return out


def max_abs_diff(logits: dict, reference: torch.Tensor) -> dict:
    return {path: (out - reference).abs().max().item() for path, out in logits.items()}


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("source", help="the source checkpoint (alias, folder or GGUF)")
    parser.add_argument("converted", help="an MLA checkpoint converted from it")
    parser.add_argument("--windows", type=int, default=2, help="held-out windows of 512 tokens")
    args = parser.parse_args()
    src = load_source(args.source)
    windows = token_windows(src.tokenizer, resolve_text("python-docs:heldout"), 512, args.windows)
    config = src.model.config
    rope_pairs = attention_head_dim(config) // 2
    plan = MlaPlan(kv_lora_rank=full_stack_width(config, config.num_key_value_heads, rope_pairs),
                   qk_rope_head_dim=2 * rope_pairs, rope_key="per_head", init="weight_svd")
    full, _ = apply_mla(src.model, plan)
    diffs = max_abs_diff(on_each_path(full, lambda model=full: model(windows).logits), src.model(windows).logits)
    print(f"full rank, all {rope_pairs} rope pairs, vs the source: max abs logit diff "
          f"explicit {diffs['explicit']:.3g}, absorbed {diffs['absorbed']:.3g}")
    del full, src

    conv = load_source(args.converted, check_supported=False)
    logits = on_each_path(conv.model, lambda: conv.model(windows).logits)
    diffs = max_abs_diff(logits, logits["explicit"])
    gens = on_each_path(conv.model, lambda: conv.model.generate(windows[:1, :128], max_new_tokens=32, do_sample=False))
    print(f"{args.converted}: absorbed vs explicit max abs logit diff {diffs['absorbed']:.3g} over "
          f"{args.windows} x 512 held-out tokens; greedy (32 tokens) identical: {torch.equal(*gens.values())}; "
          f"KV elements/token from the live cache {measure_kv_elements_per_token(conv.model):.0f}")


if __name__ == "__main__":
    main()
