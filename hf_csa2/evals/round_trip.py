"""Round trip of a saved checkpoint: reload it in a subprocess where ``import hf_csa2`` fails
(only the modeling code copied next to the weights, ``trust_remote_code=True``) and compare
its logits and greedy continuation with the model at hand.

    python -m hf_csa2.evals.round_trip runs/gemma3-csa2 --tokens 700
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import torch

from ..data.corpus import resolve_text
from ..data.windows import token_windows
from ..io.sources import load_source

REMOTE_CODE_CHECK = textwrap.dedent(
    """
    import sys, torch
    sys.modules["hf_csa2"] = None  # make `import hf_csa2` fail: this process must not need it
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    x = torch.load(sys.argv[2])
    with torch.no_grad():
        logits = model(x).logits
        gen = model.generate(x, max_new_tokens=int(sys.argv[4]), do_sample=False)
    torch.save({"logits": logits, "gen": gen}, sys.argv[3])
    """
)


def reload_without_hf_csa2(checkpoint: str | os.PathLike, x: torch.Tensor, work_dir: str | os.PathLike,
                           new_tokens: int = 5) -> dict:
    """Logits [B, T, V] and greedy output of ``checkpoint`` loaded with remote code only."""
    work = Path(work_dir)
    if Path(checkpoint).exists():  # the subprocess runs elsewhere: a relative folder must not read as a Hub ID
        checkpoint = Path(checkpoint).resolve()
    torch.save(x, work / "x.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(work / "modules")
    proc = subprocess.run(
        [sys.executable, "-c", REMOTE_CODE_CHECK, str(checkpoint), str(work / "x.pt"), str(work / "out.pt"), str(new_tokens)],
        cwd=work, env=env, capture_output=True, text=True, timeout=1800,
    )
    if proc.returncode:
        raise RuntimeError(f"remote-code reload of {checkpoint} failed:\n{proc.stderr[-3000:]}")
    return torch.load(work / "out.pt")


@torch.no_grad()
def round_trip(checkpoint: str, x: torch.Tensor, new_tokens: int = 5) -> dict:
    """Max abs logit difference and greedy agreement between ``checkpoint`` loaded by hf_csa2
    and by stock transformers with remote code only."""
    model = load_source(checkpoint, check_supported=False).model.eval()
    ours = model(x).logits
    gen = model.generate(x, max_new_tokens=new_tokens, do_sample=False)
    with tempfile.TemporaryDirectory() as tmp:
        got = reload_without_hf_csa2(checkpoint, x, tmp, new_tokens)
    return {"max_abs_logit_diff": float((got["logits"] - ours).abs().max()), "same_greedy": bool(torch.equal(got["gen"], gen)),
            "tokens": x.shape[1], "new_tokens": new_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--tokens", type=int, default=700, help="prompt length (real held-out text)")
    parser.add_argument("--text", default="python-docs:heldout")
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args()
    tokenizer = load_source(args.checkpoint, check_supported=False).tokenizer
    x = token_windows(tokenizer, resolve_text(args.text), args.tokens, 1)
    print(round_trip(args.checkpoint, x, args.new_tokens))


if __name__ == "__main__":
    main()
