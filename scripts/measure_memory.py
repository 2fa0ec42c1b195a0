"""Peak memory of a conversion, as a user's machine sees it: `/usr/bin/time -v` max RSS of one
`hf-csa2 convert` process, next to the size of the source's fp32 weights.

    python scripts/measure_memory.py smollm2 --plan conversion/smollm2-mla-quarter.yaml
    python scripts/measure_memory.py llama-1b [--keep DIR]

``smollm2``: converts the built-in SmolLM2-135M with the plan, its distill section removed
(distillation keeps a teacher and an optimizer: a separate cost). ``llama-1b``: builds a
randomly initialised ~1.1B-parameter Llama config in code (Llama-3.2-1B's shape with
SmolLM2's 49,152-token vocabulary, so its tokenizer can cut the calibration text), saves it
as an fp32 safetensors folder and converts it twice with a short calibration set: an MLA plan
and a calibrated GQA merge. Results are printed as a markdown table.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def peak_rss_bytes(cmd: list[str], log: Path) -> int:
    """Run ``cmd`` under ``/usr/bin/time -v``; its max resident set size in bytes."""
    with open(log, "w") as out:
        proc = subprocess.run(["/usr/bin/time", "-v", *cmd], stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    text = log.read_text()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}); see {log}")
    return int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1)) * 1024


def fp32_weight_bytes(folder_or_alias: str) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM
    import torch

    from hf_csa2.io.sources import load_source, resolve_source

    kind, path = resolve_source(folder_or_alias)
    if kind == "dir":
        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    else:
        model = load_source(folder_or_alias).model
    return 4 * sum(p.numel() for p in model.parameters())


def write_plan(plan: dict, folder: Path, name: str) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


def convert_cmd(source: str, plan: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "hf_csa2", "convert", source, "--plan", str(plan), "--out", str(out)]


def make_llama_1b(folder: Path) -> None:
    """A random ~1.1B Llama (fp32) with the SmolLM2 tokenizer, saved to ``folder``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_csa2.io.sources import load_source

    tokenizer = load_source("smollm2-135m").tokenizer
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=8192,
                         rope_theta=500000.0, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


SHORT_CALIBRATION = {"text": "python-docs:calib", "num_tokens": 2048, "seq_len": 256, "eval_windows": 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case", choices=["smollm2", "llama-1b"])
    parser.add_argument("--plan", default="conversion/smollm2-mla-quarter.yaml")
    parser.add_argument("--keep", help="llama-1b: build the source here (reused when present)")
    parser.add_argument("--logs", default="runs/logs", help="folder for the conversions' logs")
    args = parser.parse_args()
    logs = REPO / args.logs
    logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        rows = []
        if args.case == "smollm2":
            plan = yaml.safe_load((REPO / args.plan).read_text())
            plan.pop("distill", None)
            plan_path = write_plan(plan, tmp, Path(args.plan).stem + "-no-distill")
            weights = fp32_weight_bytes("smollm2-135m")
            rss = peak_rss_bytes(convert_cmd("smollm2-135m", plan_path, tmp / "out"), logs / "memory-smollm2.log")
            rows.append((f"smollm2-135m, {args.plan} without distill", weights, rss))
        else:
            source = Path(args.keep) if args.keep else tmp / "llama-1b"
            if not (source / "config.json").is_file():
                make_llama_1b(source)
            weights = fp32_weight_bytes(str(source))
            plans = {
                "mla": {"mla": {"kv_lora_rank": 256, "qk_rope_head_dim": 32, "compare_weight_svd": False},
                        "calibration": SHORT_CALIBRATION},
                "gqa": {"gqa": {"num_key_value_heads": 2}, "calibration": SHORT_CALIBRATION},
            }
            for name, plan in plans.items():
                plan_path = write_plan(plan, logs, f"llama-1b-{name}")  # kept: scripts/rss_profile.py takes it
                rss = peak_rss_bytes(convert_cmd(str(source), plan_path, tmp / f"out-{name}"),
                                     logs / f"memory-llama-1b-{name}.log")
                rows.append((f"random Llama ~1.1B, {name} ({yaml.safe_dump(plan[name], default_flow_style=True).strip()}, "
                             "2,048 calibration tokens)", weights, rss))
    print("| conversion | fp32 weights (GB) | peak RSS (GB) | ratio |")
    print("|---|---:|---:|---:|")
    for what, weights, rss in rows:
        print(f"| {what} | {weights / 1e9:.3f} | {rss / 1e9:.3f} | {rss / weights:.2f} |")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
