"""Reload a saved checkpoint in a subprocess where ``import hf_csa2`` fails (remote code only)."""

import os
import subprocess
import sys
import textwrap

import torch

REMOTE_CODE_CHECK = textwrap.dedent(
    """
    import sys, torch
    sys.modules["hf_csa2"] = None  # make `import hf_csa2` fail: this process must not need it
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    x = torch.load(sys.argv[2])
    logits = model(x).logits
    gen = model.generate(x, max_new_tokens=5, do_sample=False)
    torch.save({"logits": logits, "gen": gen}, sys.argv[3])
    """
)


def assert_reloads_without_hf_csa2(model, x: torch.Tensor, tmp_path) -> None:
    """Save ``model``, reload it with only its copied code, and compare logits and greedy output."""
    model.save_pretrained(tmp_path / "ckpt")
    torch.save(x, tmp_path / "x.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(tmp_path / "modules")
    proc = subprocess.run(
        [sys.executable, "-c", REMOTE_CODE_CHECK, str(tmp_path / "ckpt"), str(tmp_path / "x.pt"), str(tmp_path / "out.pt")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    torch.testing.assert_close(got["logits"], model(x).logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(got["gen"], model.generate(x, max_new_tokens=5, do_sample=False))
