"""Reload a saved checkpoint in a subprocess where ``import hf_csa2`` fails (remote code only)."""

import torch

from hf_csa2.evals.round_trip import reload_without_hf_csa2


def assert_reloads_without_hf_csa2(model, x: torch.Tensor, tmp_path) -> None:
    """Save ``model``, reload it with only its copied code, and compare logits and greedy output."""
    model.save_pretrained(tmp_path / "ckpt")
    got = reload_without_hf_csa2(tmp_path / "ckpt", x, tmp_path)
    torch.testing.assert_close(got["logits"], model(x).logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(got["gen"], model.generate(x, max_new_tokens=5, do_sample=False))
