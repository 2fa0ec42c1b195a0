"""``lowrank`` layers: dense attention over rank-r codes of the layer's own keys (before RoPE) and
values. At full rank the fitted codes reproduce the source exactly; cached decode (keys rotated at
their cached positions) equals one full forward; padded batches, live cache size and saved
checkpoints as for every other layer kind."""

import pytest
import torch
from remote_code import assert_reloads_without_hf_csa2
from tiny_models import ARCHS, tiny_model

from hf_csa2.metrics.kv_cache import config_kv_elements_at_context, live_cache_elements
from hf_csa2.model.layer_specs import AttentionSpec
from hf_csa2.surgery.calibration import attention_input_moments
from hf_csa2.surgery.lowrank import fit_lowrank_layer
from hf_csa2.surgery.rebuild import to_csa2

from .test_csa2_attention import csa2_model, ids
from .test_padded_batches import assert_left_padding_reads_as_alone

HEAD_DIM = 12  # tiny_models
MIXED_LOWRANK = (["full", "lowrank", "reuse", "swa", "lowrank"], [None, None, 0, None, None])


def lowrank_model(arch, key_rank, value_rank, num_layers=2, sinks=False):
    """A tiny source and the same model with every layer ``lowrank``, codes fitted on random text."""
    src = tiny_model(arch, num_layers=num_layers)
    kv = src.config.num_key_value_heads
    spec = {"kind": "lowrank", "num_key_value_heads": kv, "sinks": sinks, "key_rank": key_rank, "value_rank": value_rank}
    model = to_csa2(src, [spec] * num_layers)
    model.config._attn_implementation = "eager"
    moments = attention_input_moments(src, ids(batch=4, length=24, seed=7))
    for i, layer in enumerate(model.model.layers):
        fit_lowrank_layer(layer.self_attn, src.model.layers[i].self_attn, moments[i])
    return model, src


def cached_decode_logits(model, x: torch.Tensor, prefill: int) -> torch.Tensor:
    with torch.no_grad():
        out = model(x[:, :prefill], use_cache=True)
        logits, cache = [out.logits], out.cache
        for j in range(prefill, x.shape[1]):
            out = model(x[:, j : j + 1], cache=cache, use_cache=True)
            logits.append(out.logits)
            cache = out.cache
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize("arch", ARCHS)
def test_full_rank_codes_reproduce_the_source(arch):
    width = 2 * HEAD_DIM  # 2 KV heads
    model, src = lowrank_model(arch, width, width)
    x = ids(batch=2, length=20)
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, src(x).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_cached_decode_rotates_keys_at_their_positions(arch):
    """A cache holds unrotated codes; each step rebuilds and rotates them at the positions they
    were cached at (mistral and gemma3's sliding layers drop old codes, as the source's cache does)."""
    model, _ = lowrank_model(arch, 7, 5)
    x = ids(batch=2, length=19)
    with torch.no_grad():
        full = model(x).logits
    torch.testing.assert_close(cached_decode_logits(model, x, prefill=9), full, atol=1e-4, rtol=1e-4)


def test_cut_codes_change_the_output_and_the_cut_shows_in_the_fit():
    """A rank below the width loses something (the test above would pass for any exact copy)."""
    model, src = lowrank_model("llama", 3, 3)
    x = ids(batch=2, length=20)
    with torch.no_grad():
        assert (model(x).logits - src(x).logits).abs().max() > 1e-2


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3_text"])
def test_left_padded_batches_with_lowrank_layers_read_as_alone(arch):
    model, _, _ = csa2_model(arch, *MIXED_LOWRANK)
    assert_left_padding_reads_as_alone(model, arch)


def test_live_cache_holds_the_codes_and_matches_the_config_count():
    model, _, _ = csa2_model("llama", *MIXED_LOWRANK, lowrank_ranks=(6, 5))
    n = 11
    with torch.no_grad():
        cache = model(ids(batch=1, length=n), use_cache=True).cache
    for i in (1, 4):
        layer = cache.layers[i]
        assert layer.keys.shape[-1] == 6 and layer.values.shape[-1] == 5 and layer.keys.shape[-2] == n
    assert live_cache_elements(cache) == config_kv_elements_at_context(model.config, n)


def test_saved_checkpoint_reloads_without_hf_csa2(tmp_path):
    model, _, _ = csa2_model("qwen3", *MIXED_LOWRANK)
    with torch.no_grad():
        assert_reloads_without_hf_csa2(model, ids(batch=1, length=9), tmp_path)


@pytest.mark.parametrize("field,value,message", [
    ("key_rank", 25, "key_rank=25 exceeds the layer's key/value width 24"),
    ("value_rank", 0, "value_rank=0 must be an integer >= 1"),
    ("key_rank", None, "key_rank=None must be an integer >= 1"),
])
def test_spec_refuses_bad_ranks(field, value, message):
    data = {"kind": "lowrank", "num_key_value_heads": 2, "key_rank": 8, "value_rank": 8, field: value}
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        AttentionSpec.from_dict(data, 3, num_attention_heads=4, head_dim=HEAD_DIM)
