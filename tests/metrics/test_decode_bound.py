"""The decode-step read bound: what each layer reads, checked against the index lists a real
decode step of every CSA2 mode builds; weights counted once (tied) or without the input table."""

import functools
import math

import pytest
import torch
from tiny_models import tiny_model

import hf_csa2.model.csa2_attention as csa2_attention
from hf_csa2.metrics.decode_bound import (
    decode_read_bytes,
    decode_read_elements,
    layer_reads,
    measure_read_bandwidth,
    weight_read_bytes,
)
from hf_csa2.metrics.kv_cache import layer_attention_specs

from ..model.test_csa2_attention import MIXED_PLAN, csa2_model, ids


@functools.lru_cache(maxsize=None)
def mixed_model(exact_window: bool = False, sink_tokens: int = 0):
    return csa2_model("llama", *MIXED_PLAN, window=3, top_k=4, exact_window=exact_window, sink_tokens=sink_tokens)[0]


def recorded_reads(model, context: int) -> list[list[int]]:
    """Per CSA2 layer, the valid entries of each segment the last query of a decode step reads
    (prefill of ``context - 1`` tokens, then one token)."""
    calls = []
    reference = csa2_attention.sparse_sink_attention

    def recording(segments, **kwargs):
        calls.append([int((s.index[0, -1] >= 0).sum()) for s in segments])
        return reference(segments, **kwargs)

    x = ids(batch=1, length=context)
    with torch.no_grad():
        out = model(x[:, :-1], use_cache=True)
        csa2_attention.sparse_sink_attention = recording
        try:
            model(x[:, -1:], cache=out.cache, use_cache=True)
        finally:
            csa2_attention.sparse_sink_attention = reference
    return calls


@pytest.mark.parametrize("exact_window", [False, True])
@pytest.mark.parametrize("context", [2, 4, 5, 9, 13])
def test_layer_reads_are_what_a_decode_step_reads(context, exact_window):
    model = mixed_model(exact_window)
    specs = layer_attention_specs(model.config)
    recorded = recorded_reads(model, context)
    assert len(recorded) == len(specs)
    for i, (spec, segments) in enumerate(zip(specs, recorded)):
        reads = layer_reads(specs, i, context)
        if spec["mode"] == "full" and not exact_window:
            expected = [reads.entries]  # Top-K and the window, both from the latent
        elif spec["mode"] in ("full", "reindex", "reuse"):
            expected = [reads.own, reads.entries]
        else:
            expected = [reads.own]
        assert segments == expected, (i, spec["mode"], context)
        assert reads.index_keys == (context if spec["mode"] in ("full", "reindex") else 0)


def test_sink_tokens_are_read_from_the_own_segment():
    model = mixed_model(sink_tokens=2)
    specs = layer_attention_specs(model.config)
    for context in (4, 9, 13):
        for i, (spec, segments) in enumerate(zip(specs, recorded_reads(model, context))):
            reads = layer_reads(specs, i, context)
            if spec["mode"] != "full":
                assert segments[0] == reads.own == min(context, 3) + min(2, max(0, context - 3))
            if len(segments) == 2 and spec["mode"] != "full":  # picks on the first tokens come from the own segment
                assert reads.entries - 2 <= segments[1] <= reads.entries


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3_text"])
def test_dense_sources_read_their_whole_cache_or_window(arch):
    model = tiny_model(arch)  # 2 layers, 2 KV heads of 12; mistral/gemma3 slide over 7 tokens
    per_token = 2 * 2 * 12
    for context in (1, 6, 7, 8, 100):
        window = min(context, 7)
        layers = {"llama": [context, context], "mistral": [window, window], "gemma3_text": [window, context]}[arch]
        assert decode_read_elements(model.config, context) == sum(layers) * per_token


def test_latent_layers_read_latent_entries_not_per_head_keys():
    model, mla, _ = csa2_model("llama", ["full"] * 2, [None] * 2, window=3, top_k=4)
    spec = layer_attention_specs(mla.config)[0]
    width = spec["kv_lora_rank"] + sum(2 * len(p) for p in spec["rope_pairs"])
    assert decode_read_elements(mla.config, 10) == 2 * 10 * width
    # CSA2 full layers: window + Top-K entries and every index key (8 wide)
    assert decode_read_elements(model.config, 10) == 2 * (7 * width + 10 * 8)
    assert decode_read_elements(model.config, 1000) == 2 * (7 * width + 1000 * 8)


def test_weights_are_read_once_and_an_untied_input_table_only_one_row():
    tied, untied = tiny_model("llama"), tiny_model("qwen2")
    assert weight_read_bytes(tied) == sum(p.numel() * 4 for p in tied.parameters())
    table = untied.get_input_embeddings().weight
    assert weight_read_bytes(untied) == sum(p.numel() * 4 for p in untied.parameters()) - (table.shape[0] - 1) * table.shape[1] * 4
    assert decode_read_bytes(tied, 50, batch=3) == weight_read_bytes(tied) + 3 * decode_read_elements(tied.config, 50) * 4


def test_read_bandwidth_is_a_plausible_rate():
    rate = measure_read_bandwidth(num_bytes=2**24, repeats=2)
    assert math.isfinite(rate) and 1e8 < rate < 1e13  # 0.1 GB/s .. 10 TB/s
