"""Which part of a conversion costs its answers: put source pieces back into the converted model
one at a time and re-ask the answer check (and the teacher-forced agreement) on the same windows.

    python scripts/ablate_answers.py SOURCE CONVERTED [--text python-docs:heldout] [--context 512,1024]
        [--per-depth 6] [--restore o_proj:11,17] [--restore o_proj:all]

Each ``--restore PART:LAYERS`` is one variant: ``o_proj`` copies the source's output projection
into those layers (what the conversion would give without its o_proj refits: the converted layers
keep the source's head layout of values, so the source o_proj applies as is); ``attn`` puts the
source's whole attention module back (dense over the full prefix: no latent, no reuse, no sparse
read), e.g. in the reuse layers only, to see what they cost. Prints one row per
variant and context: answer check far/near, answer NLL, top-1 agreement and KL over all positions.
"""

from __future__ import annotations

import argparse
import copy

import torch

from hf_csa2.data.windows import token_windows
from hf_csa2.evals.compare import compare_models
from hf_csa2.io.sources import load_source
from hf_csa2.metrics.answer_check import answer_check, make_probes


class _DenseFromSource(torch.nn.Module):
    """The source's attention module in a converted model's layer: dense over the whole causal
    prefix (its own mask is built here, the converted model passes its own kind), no cache."""

    def __init__(self, attn):
        super().__init__()
        self.attn = attn

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        t = hidden_states.shape[1]
        mask = torch.full((t, t), float("-inf"), dtype=hidden_states.dtype, device=hidden_states.device).triu(1)
        return self.attn(hidden_states, position_embeddings=position_embeddings, attention_mask=mask[None, None],
                         past_key_values=None)


def restored(converted, source, part: str, layers: str):
    model = copy.deepcopy(converted)
    n = len(model.model.layers)
    picked = range(n) if layers == "all" else [int(x) for x in layers.split(",")]
    with torch.no_grad():
        for i in picked:
            if part == "o_proj":
                model.model.layers[i].self_attn.o_proj.weight.copy_(source.model.layers[i].self_attn.o_proj.weight)
            elif part == "attn":
                model.model.layers[i].self_attn = _DenseFromSource(copy.deepcopy(source.model.layers[i].self_attn))
            else:
                raise SystemExit(f"unknown part {part!r}; allowed: o_proj, attn")
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source")
    parser.add_argument("converted")
    parser.add_argument("--text", default="python-docs:heldout")
    parser.add_argument("--context", default="512,1024")
    parser.add_argument("--per-depth", type=int, default=6)
    parser.add_argument("--windows", type=int, default=3, help="text windows the probes are cut from")
    parser.add_argument("--restore", action="append", default=[], metavar="PART:LAYERS")
    args = parser.parse_args()
    source = load_source(args.source)
    converted = load_source(args.converted).model.eval()
    if getattr(converted.config, "csa2_read_path", None):
        converted.config.csa2_read_path = "scores"  # exact like the reference "gather", much faster at these lengths
    variants = [("as converted", converted)]
    for spec in args.restore:
        part, layers = spec.split(":")
        variants.append((f"source {part} in {layers}", restored(converted, source.model, part, layers)))
    print("| variant | context | answers far | near | answer NLL | top-1 agreement | KL |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for context in [int(c) for c in args.context.split(",")]:
        windows = token_windows(source.tokenizer, args.text, context, args.windows)
        probes = make_probes(source.tokenizer, windows, args.per_depth)
        ref = answer_check(source.model, probes)
        print(f"| source | {context} | {ref.far}/{ref.per_depth} | {ref.near}/{ref.per_depth} | {ref.answer_nll:.3f} | 1 | 0 |")
        for name, model in variants:
            check = answer_check(model, probes)
            cmp = compare_models(source.model, model, windows[:1], bucket=context)
            print(f"| {name} | {context} | {check.far}/{check.per_depth} | {check.near}/{check.per_depth} | "
                  f"{check.answer_nll:.3f} | {cmp.top1_agreement:.3f} | {cmp.buckets[0].kl:.4f} |", flush=True)


if __name__ == "__main__":
    main()
