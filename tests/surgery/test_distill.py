"""End-to-end distillation toward the source (hf_csa2.surgery.distill)."""

import pytest
import torch
from tiny_models import VOCAB, tiny_model

from hf_csa2.surgery.mla import apply_mla
from hf_csa2.surgery.distill import distill_to_source, token_kl, trainable_parameters
from hf_csa2.surgery.plan import MlaPlan


def test_token_kl_is_zero_for_equal_logits_and_positive_otherwise():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(2, 5, 11, generator=gen)
    assert token_kl(a, a).item() == pytest.approx(0.0, abs=1e-6)
    assert token_kl(a, a + 3.0).item() == pytest.approx(0.0, abs=1e-6)  # shift-invariant: same distribution
    b = torch.randn(2, 5, 11, generator=gen)
    p, q = torch.softmax(a, -1), torch.softmax(b, -1)
    expected = (p * (p.log() - q.log())).sum(-1).mean()
    assert token_kl(a, b).item() == pytest.approx(expected.item(), rel=1e-5)


def test_trainable_parameters_attention_are_the_attention_modules_only():
    model = tiny_model("llama")
    attn = {id(p) for p in trainable_parameters(model, "attention")}
    assert attn == {id(p) for layer in model.model.layers for p in layer.self_attn.parameters()}
    every = {id(p) for p in trainable_parameters(model, "all")}
    assert id(model.model.embed_tokens.weight) not in every and attn < every
    with pytest.raises(ValueError, match="allowed: attention, all"):
        trainable_parameters(model, "mlp")


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_distillation_moves_an_mla_conversion_toward_its_source(arch):
    """A crude MLA conversion (rank 4) distilled on random calibration windows: the held-out KL
    never rises, it falls, logits on windows never seen move toward the source's, only the
    attention parameters change, and the source is untouched."""
    src = tiny_model(arch)
    src_state = {k: v.clone() for k, v in src.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    fit = torch.randint(3, VOCAB, (24, 32), generator=gen)
    unseen = torch.randint(3, VOCAB, (4, 32), generator=gen)
    model, _ = apply_mla(src, MlaPlan(kv_lora_rank=4, qk_rope_head_dim=4, rope_key="per_head"), windows=fit[:8])
    start = {k: v.clone() for k, v in model.state_dict().items()}

    def distance():
        with torch.no_grad():
            return token_kl(src(unseen).logits, model(unseen).logits).item()

    before = distance()
    notes = distill_to_source(model, src, fit, steps=60, lr=3e-3, batch=4, holdout=4, every=5)
    assert notes["distill_heldout_kl_after"] < notes["distill_heldout_kl_before"]
    assert notes["distill_kept_step"] > 0
    assert distance() < before
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, start[k])}
    assert changed and all(".self_attn." in k for k in changed)
    assert all(torch.equal(v, src_state[k]) for k, v in src.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert all(p.requires_grad for p in model.parameters())  # restored as it was


def test_distillation_keeps_the_start_when_no_step_helps():
    src = tiny_model("llama")
    fit = torch.randint(3, VOCAB, (8, 24), generator=torch.Generator().manual_seed(2))
    model, _ = apply_mla(src, MlaPlan(kv_lora_rank=4, qk_rope_head_dim=4, rope_key="per_head"), windows=fit)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    notes = distill_to_source(model, src, fit, steps=5, lr=50.0, holdout=2, every=1)
    assert notes["distill_kept_step"] == 0
    assert notes["distill_heldout_kl_after"] == notes["distill_heldout_kl_before"]
    assert all(torch.equal(v, start[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("kwargs, match", [
    (dict(holdout=0), "holdout=0; allowed: 1..7"),
    (dict(holdout=8), "holdout=8; allowed: 1..7"),
    (dict(lr=0.0), "allowed: steps >= 0, lr > 0"),
    (dict(trainable="mlp"), "allowed: attention, all"),
])
def test_distillation_refuses_bad_arguments_before_training(kwargs, match):
    src = tiny_model("llama")
    fit = torch.randint(3, VOCAB, (8, 16), generator=torch.Generator().manual_seed(3))
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=match):
        distill_to_source(model, src, fit, **{"steps": 1, **kwargs})
