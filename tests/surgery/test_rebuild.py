"""Rebuilding on the meta device (hf_csa2.surgery.rebuild): a conversion shares the source's
unchanged tensors instead of copying them, copies what the surgery rewrites, and never
changes the source, which every fit and the distillation read."""

import pytest
import torch
from tiny_models import ARCHS, VOCAB, tiny_model

from hf_csa2.surgery.distill import distill_to_source
from hf_csa2.surgery.gqa import apply_gqa
from hf_csa2.surgery.plan import GqaPlan
from hf_csa2.surgery.rebuild import native_specs, to_csa2, to_native
from hf_csa2.surgery.sinks import add_sinks


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def snapshot(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_state(model, saved: dict) -> None:
    now = model.state_dict()
    assert now.keys() == saved.keys()
    changed = [k for k in saved if not torch.equal(now[k], saved[k])]
    assert not changed, changed


@pytest.mark.parametrize("arch", ARCHS)
def test_rebuild_shares_unchanged_tensors_copies_attention_and_keeps_the_logits(arch):
    src = tiny_model(arch)
    ids = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    new = to_csa2(src, native_specs(src.config))
    own, theirs = new.state_dict(), src.state_dict()
    for key, value in own.items():
        if ".self_attn." in key:
            assert storage(value) != storage(theirs[key]), key
        else:
            assert storage(value) == storage(theirs[key]), key
    assert not any(t.is_meta for t in [*new.parameters(), *new.buffers()])
    with torch.no_grad():
        torch.testing.assert_close(new(input_ids=ids).logits, src(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    if src.config.tie_word_embeddings:
        assert new.lm_head.weight is new.model.embed_tokens.weight
    native = to_native(new)
    with torch.no_grad():
        torch.testing.assert_close(native(input_ids=ids).logits, src(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_surgery_never_changes_the_source_in_memory(arch):
    """A calibrated GQA merge refits o_proj in place and sinks get calibrated in place: on
    shared tensors that would rewrite the source, so every fit after the first would chase a
    moved target."""
    src = tiny_model(arch, num_kv_heads=4)
    saved = snapshot(src)
    windows = torch.randint(3, VOCAB, (6, 32), generator=torch.Generator().manual_seed(1))
    merged = apply_gqa(src, GqaPlan(num_key_value_heads=1), windows=windows)[0]
    assert_same_state(src, saved)
    attn = merged.model.layers[0].self_attn
    assert not torch.equal(attn.o_proj.weight, src.model.layers[0].self_attn.o_proj.weight)  # the refit happened
    sinks = add_sinks(merged)
    merged_o = merged.model.layers[0].self_attn.o_proj.weight.detach().clone()
    with torch.no_grad():  # a stage writing its attention in place must not reach the model it came from
        sinks.model.layers[0].self_attn.o_proj.weight.add_(1.0)
        for layer in sinks.model.layers:
            layer.self_attn.sinks.fill_(1.0)
    assert torch.equal(merged.model.layers[0].self_attn.o_proj.weight, merged_o)
    assert_same_state(src, saved)

def test_new_parameters_are_initialised_not_left_empty():
    src = tiny_model("llama")
    new = add_sinks(src)
    for layer in new.model.layers:
        assert torch.isfinite(layer.self_attn.sinks).all()
        # the sink-off init: a sink that takes no probability mass
        assert (layer.self_attn.sinks < -1e3).all()


def test_distilling_every_parameter_leaves_the_shared_teacher_unchanged():
    """trainable='all' trains MLPs and norms, which the conversion shares with the source:
    they are copied first, so the teacher stays the source."""
    src = tiny_model("llama", num_kv_heads=4)
    saved = snapshot(src)
    windows = torch.randint(3, VOCAB, (10, 24), generator=torch.Generator().manual_seed(2))
    student = apply_gqa(src, GqaPlan(num_key_value_heads=1, init="mean"))[0]
    mlp_before = student.model.layers[0].mlp.up_proj.weight.detach().clone()
    assert storage(student.model.layers[0].mlp.up_proj.weight) == storage(src.model.layers[0].mlp.up_proj.weight)
    notes = distill_to_source(student, src, windows, steps=6, lr=3e-3, batch=2, holdout=2, every=2, trainable="all")
    assert_same_state(src, saved)
    assert storage(student.model.layers[0].mlp.up_proj.weight) != storage(src.model.layers[0].mlp.up_proj.weight)
    if notes["distill_kept_step"] > 0:
        assert not torch.equal(student.model.layers[0].mlp.up_proj.weight, mlp_before)
