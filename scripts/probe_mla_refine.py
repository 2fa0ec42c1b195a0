"""Layer-level probe of ``mla.refine_steps``: convert only some layers of a source with a plan's
MLA settings, with the Adam refinement after the closed-form fit, and print each layer's
output error (closed form, after the o_proj refit, held-out before/after the refinement) for
each learning rate. Much cheaper than a whole conversion; the whole-model effect needs one.

    python scripts/probe_mla_refine.py smollm2-135m conversion/smollm2-mla-quarter.yaml --layers 3,15 --steps 80 --lrs 1e-4,3e-4
"""

import argparse
import dataclasses
import time

import torch

from hf_csa2.surgery.mla import apply_mla
from hf_csa2.surgery.pipeline import prepare_source
from hf_csa2.surgery.plan import ConversionPlan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source")
    ap.add_argument("plan", help="plan YAML with an mla section")
    ap.add_argument("--layers", required=True, help="comma-separated layer indices")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--lrs", default="1e-4,3e-4", help="comma-separated learning rates")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    plan = ConversionPlan.from_yaml(args.plan)
    if plan.mla is None:
        raise SystemExit(f"{args.plan} has no mla section")
    mla = plan.mla
    src = prepare_source(args.source, plan)
    layers = [int(x) for x in args.layers.split(",")]
    for lr in (float(x) for x in args.lrs.split(",")):
        t0 = time.perf_counter()
        # The plan's own fields, but the refinement of this probe (latent_norm/uniform_rope off, as before).
        probe = dataclasses.replace(mla, latent_norm=False, uniform_rope=False, refit_output=True,
                                    refine_steps=args.steps, refine_lr=lr)
        _, report = apply_mla(src.model, probe, windows=src.calib.fit, only_layers=layers)
        print(f"lr {lr:g} ({time.perf_counter() - t0:.0f} s)")
        for i in layers:
            n = report.layers[i]
            print(f"  layer {i}: closed form {n.rel_err:.4f}, o_proj refit {n.rel_err_after:.4f}, held-out "
                  f"{n.refine_heldout_err_before:.4f} -> {n.refine_heldout_err_after:.4f} (kept step {n.refine_kept_step})")


if __name__ == "__main__":
    main()
