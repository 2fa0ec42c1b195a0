"""Csa2ForCausalLM on tiny configs of every supported architecture."""

import json

import pytest
import torch
from remote_code import assert_reloads_without_hf_csa2
from tiny_models import ARCHS, VOCAB, tiny_model
from transformers import AutoModelForCausalLM

import hf_csa2  # noqa: F401  (registers the Auto classes)
from hf_csa2.model import Csa2ForCausalLM
from hf_csa2.surgery.gqa import apply_gqa
from hf_csa2.surgery.plan import GqaPlan
from hf_csa2.surgery.sinks import add_sinks


def with_sinks(model, values=None, kv_heads=None):
    if kv_heads is not None:
        model = apply_gqa(model, GqaPlan(num_key_value_heads=kv_heads, init="mean"))[0]
    new = add_sinks(model)
    if values is not None:
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for layer in new.model.layers:
                layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=g) + values)
    return new


def ids(batch=2, length=13, seed=0):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_sinks_off_reproduce_source(arch, impl):
    src = tiny_model(arch)
    model = with_sinks(src)
    src.set_attn_implementation(impl)
    model.set_attn_implementation(impl)
    x = ids()
    torch.testing.assert_close(model(x).logits, src(x).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_eager_and_sdpa_agree_with_active_sinks(arch):
    model = with_sinks(tiny_model(arch), values=0.0)
    x = ids()
    model.set_attn_implementation("eager")
    a = model(x).logits
    model.set_attn_implementation("sdpa")
    torch.testing.assert_close(model(x).logits, a, atol=1e-5, rtol=1e-5)
    # and the sinks really act: the output differs from the sink-free source
    assert (a - tiny_model(arch)(x).logits).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_save_and_native_reload(arch, tmp_path):
    model = with_sinks(tiny_model(arch), values=-1.0)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "hf_csa2" and config["base_model_type"] == arch
    assert "AutoModelForCausalLM" in config["auto_map"]
    assert (tmp_path / "modeling_hf_csa2.py").exists() and (tmp_path / "sink_attention.py").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert isinstance(loaded, Csa2ForCausalLM)
    x = ids()
    torch.testing.assert_close(loaded(x).logits, model(x).logits, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_prefill_then_decode_equals_full_forward(arch, impl):
    model = with_sinks(tiny_model(arch), values=0.0, kv_heads=1)
    model.set_attn_implementation(impl)
    x = ids(length=16)
    full = model(x).logits
    out = model(x[:, :9], use_cache=True)
    steps = [out.logits]
    cache = out.cache
    for t in range(9, 16):
        out = model(x[:, t : t + 1], cache=cache, use_cache=True)
        cache = out.cache
        steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_left_padded_batch_matches_single_sequences(arch):
    model = with_sinks(tiny_model(arch), values=0.0)
    model.set_attn_implementation("sdpa")
    long, short = ids(1, 11, seed=1), ids(1, 6, seed=2)
    batch = torch.zeros(2, 11, dtype=torch.long)
    batch[0], batch[1, 5:] = long[0], short[0]
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, :5] = 0
    out = model(batch, attention_mask=mask).logits
    torch.testing.assert_close(out[0], model(long).logits[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out[1, 5:], model(short).logits[0], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_greedy_sampling_beam(arch):
    model = with_sinks(tiny_model(arch), values=0.0, kv_heads=1)
    model.generation_config.eos_token_id = None  # always 6 new tokens: compare them all
    x = ids(2, 5)
    greedy = model.generate(x, max_new_tokens=6, do_sample=False)
    # greedy with the cache must equal argmax decoding without it
    seq = x
    for _ in range(6):
        nxt = model(seq).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(greedy, seq)
    static = model.generate(x, max_new_tokens=6, do_sample=False, cache_implementation="static")
    assert torch.equal(static, greedy)
    torch.manual_seed(0)
    sampled = model.generate(x, max_new_tokens=6, do_sample=True, top_k=20)
    beams = model.generate(x, max_new_tokens=6, num_beams=3, do_sample=False)
    assert sampled.shape == beams.shape == (2, 11)


def test_flash_attention_is_refused():
    model = with_sinks(tiny_model("llama"))
    with pytest.raises((ValueError, ImportError)):
        model.set_attn_implementation("flash_attention_2")


def test_calibrated_sinks_have_a_gradient():
    from hf_csa2.surgery.sinks import calibrate_sinks

    model = with_sinks(tiny_model("llama"))
    x = ids()
    calibrate_sinks(model, x)  # exact init: output unchanged ...
    loss = model(x).logits.square().mean()
    loss.backward()
    grads = torch.stack([layer.self_attn.sinks.grad.abs().max() for layer in model.model.layers])
    assert (grads > 0).all()  # ... but not frozen, unlike a -1e4 sink


def test_sinks_are_trainable_and_act_as_the_gate():
    """Train only the sinks; they move, the output changes, and the change is exactly the
    seed-004 gate sigma(lse - s) applied to each head's dense output."""
    model = with_sinks(tiny_model("llama"))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-6.0)  # opened: small effect, live gradient
    x = ids()
    before = model(x).logits.detach()
    params = [layer.self_attn.sinks for layer in model.model.layers]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=0.5)
    target = ids(seed=9)
    for _ in range(10):
        loss = torch.nn.functional.cross_entropy(model(x).logits.flatten(0, 1), target.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    moved = torch.stack([(p + 6.0).abs().max() for p in params]).max()
    assert moved > 1.0
    after = model(x).logits.detach()
    assert (after - before).abs().max() > 1e-3
    # "accordingly": the first layer's output is o_proj(gate * dense) with gate = sigma(lse - s)
    attn = model.model.layers[0].self_attn
    captured = {}
    handle = attn.register_forward_hook(lambda m, a, k, out: captured.setdefault("out", out[0]), with_kwargs=True)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        model(x)
        handle.remove()
        sinks = attn.sinks.detach()
        hidden = model.model.layers[0].input_layernorm(model.model.embed_tokens(x))
        q, k, v = attn.project(hidden, model.model.rotary_emb(hidden, torch.arange(x.shape[1])[None]))
        z = (q @ k.repeat_interleave(attn.num_key_value_groups, 1).transpose(-1, -2)) * attn.scaling
        z = z.masked_fill(torch.ones_like(z, dtype=torch.bool).triu(1), float("-inf"))
        gate = torch.sigmoid(torch.logsumexp(z, -1) - sinks[None, :, None])  # [B, HQ, T]
        dense = torch.softmax(z, -1) @ v.repeat_interleave(attn.num_key_value_groups, 1)  # [B, HQ, T, D]
        expected = attn.o_proj((dense * gate[..., None]).transpose(1, 2).flatten(2))
    torch.testing.assert_close(captured["out"], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_reload_without_hf_csa2_via_remote_code(arch, tmp_path):
    assert_reloads_without_hf_csa2(with_sinks(tiny_model(arch), values=-1.0, kv_heads=1), ids(), tmp_path)
