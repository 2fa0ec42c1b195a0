"""MLA layers (LatentAttention) on tiny configs of every supported architecture:
full-rank exactness, explicit == absorbed, cache consistency, cache size, sinks, reload."""

import pytest
import torch
from remote_code import assert_reloads_without_hf_csa2
from tiny_models import ARCHS, VOCAB, tiny_model

from hf_csa2.metrics.kv_cache import config_kv_elements_per_token, measure_kv_elements_per_token
from hf_csa2.model import Csa2Config, LatentAttention
from hf_csa2.surgery.mla import apply_mla, full_stack_width
from hf_csa2.surgery.plan import MlaPlan
from hf_csa2.surgery.sinks import add_sinks

QK_NORM = ("qwen3", "gemma3_text")
D = 12  # tiny head_dim


def ids(batch=2, length=13, seed=0):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def windows(seed=1):
    return torch.randint(3, VOCAB, (4, 32), generator=torch.Generator().manual_seed(seed))


def logits_by_path(model, x, path):
    model.config.mla_attention_path = path
    try:
        return model(x).logits
    finally:
        model.config.mla_attention_path = "auto"


def low_rank_mla(arch, shared=False, sinks=False):
    src = tiny_model(arch)
    rope_key = "shared" if shared else "per_head"
    model, _ = apply_mla(src, MlaPlan(kv_lora_rank=6, qk_rope_head_dim=4, rope_key=rope_key), windows=windows())
    if sinks:
        model = add_sinks(model)
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=g))
    return model


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("path", ["explicit", "absorbed"])
def test_full_rank_all_pairs_reproduces_the_source(arch, path):
    src = tiny_model(arch)
    kv = src.config.num_key_value_heads
    plan = MlaPlan(kv_lora_rank=full_stack_width(src.config, kv, D // 2), qk_rope_head_dim=D, rope_key="per_head",
                   init="weight_svd")
    model, _ = apply_mla(src, plan)
    x = ids()
    assert (logits_by_path(model, x, path) - src(x).logits).abs().max() <= 1e-4


@pytest.mark.parametrize("arch", [a for a in ARCHS if a not in QK_NORM])
@pytest.mark.parametrize("path", ["explicit", "absorbed"])
def test_shared_rope_key_with_every_component_reproduces_the_source(arch, path):
    """Mixed shared key (RoRoPE-style): all H components of every frequency kept -> exact."""
    src = tiny_model(arch)
    kv = src.config.num_key_value_heads
    slots = kv * D // 2
    plan = MlaPlan(kv_lora_rank=full_stack_width(src.config, kv, slots, shared=True), qk_rope_head_dim=2 * slots,
                   rope_key="shared", init="weight_svd")
    model, _ = apply_mla(src, plan, windows=windows())
    assert model.model.layers[0].self_attn.mixed_rope
    x = ids()
    assert (logits_by_path(model, x, path) - src(x).logits).abs().max() <= 1e-4


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("shared", [False, True])
def test_absorbed_equals_explicit_at_low_rank_with_sinks(arch, shared):
    if shared and arch in QK_NORM:
        pytest.skip("a shared rope key is refused for QK-norm sources with several KV heads")
    model = low_rank_mla(arch, shared=shared, sinks=True)
    x = ids()
    explicit = logits_by_path(model, x, "explicit")
    absorbed = logits_by_path(model, x, "absorbed")
    assert (explicit - absorbed).abs().max() <= 1e-4
    model.config._attn_implementation = "sdpa"
    assert (logits_by_path(model, x, "absorbed") - explicit).abs().max() <= 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_chunks_and_decode_equal_full_forward(arch):
    model = low_rank_mla(arch, sinks=True)
    x = ids(length=15)
    full = model(x).logits
    out = model(x[:, :6], use_cache=True)
    parts, cache = [out.logits], out.cache
    for chunk in (x[:, 6:9], x[:, 9:10], x[:, 10:11], x[:, 11:15]):  # chunked prefill and one-token (absorbed) steps
        o = model(chunk, cache=cache, use_cache=True)
        parts.append(o.logits)
    assert (torch.cat(parts, 1) - full).abs().max() <= 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_generation_is_identical_on_both_paths_and_caches(arch):
    model = low_rank_mla(arch)
    x = ids(batch=1, length=6)
    runs = {}
    for path in ("explicit", "absorbed", "auto"):
        model.config.mla_attention_path = path
        runs[path] = model.generate(x, max_new_tokens=6, do_sample=False)
    model.config.mla_attention_path = "auto"
    runs["static"] = model.generate(x, max_new_tokens=6, do_sample=False, cache_implementation="static")
    runs["beam"] = model.generate(x, max_new_tokens=6, do_sample=False, num_beams=2, num_return_sequences=1)
    assert all(torch.equal(runs["explicit"], g) for k, g in runs.items() if k != "beam")
    assert runs["beam"].shape == runs["explicit"].shape


@pytest.mark.parametrize("arch", ARCHS)
def test_live_cache_holds_only_latent_and_rope_key(arch):
    model = low_rank_mla(arch)
    kv = model.config.num_key_value_heads
    per_layer = 6 + kv * 2 * 2 + (kv if arch in QK_NORM else 0)  # latent + per-head rope keys (+ key scales)
    assert config_kv_elements_per_token(model.config) == 2 * per_layer
    assert measure_kv_elements_per_token(model) == 2 * per_layer
    attn = model.model.layers[0].self_attn
    assert isinstance(attn, LatentAttention) and attn.cache_width == per_layer
    out = model(ids(batch=1, length=5), use_cache=True)
    layer = out.cache.layers[0]
    assert layer.keys.shape == (1, 1, 5, 6)  # the latent, nothing of size H x D


def test_sinks_get_a_gradient_on_the_absorbed_path():
    model = low_rank_mla("llama", sinks=True)
    model.config.mla_attention_path = "absorbed"
    model.model.layers[0].self_attn.sinks.data.fill_(0.0)
    model(ids()).logits.logsumexp(-1).mean().backward()
    assert model.model.layers[0].self_attn.sinks.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"kv_lora_rank": 0, "rope_pairs": [[0], [1]]}, "kv_lora_rank=0"),
        ({"kv_lora_rank": 4, "rope_pairs": [[0], [1], [2]]}, "one per KV head"),
        ({"kv_lora_rank": 4, "rope_pairs": [[0, 1], [1]]}, "same length"),
        ({"kv_lora_rank": 4, "rope_pairs": [[0], [6]]}, "[0, 6)"),
        ({"kv_lora_rank": 4, "rope_pairs": [[0], [1]], "window": 3}, "unknown keys"),
    ],
)
def test_bad_mla_specs_are_rejected(spec, message):
    base = tiny_model("llama").config
    layers = [{"kind": "mla", "num_key_value_heads": 2, **spec}] * 2
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        Csa2Config.from_base_config(base, layers)


def test_shared_rope_key_refused_for_qk_norm_sources():
    base = tiny_model("qwen3").config
    with pytest.raises(ValueError, match="QK-norm"):
        Csa2Config.from_base_config(base, [{"kind": "mla", "num_key_value_heads": 2, "kv_lora_rank": 4, "rope_pairs": [[0]]}] * 2)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_reload_without_hf_csa2_via_remote_code(arch, tmp_path):
    assert_reloads_without_hf_csa2(low_rank_mla(arch, shared=arch == "llama", sinks=True), ids(), tmp_path)
