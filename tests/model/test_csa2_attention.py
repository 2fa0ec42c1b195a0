"""CSA2 layers (full / reindex / reuse / swa) on tiny configs of every supported architecture:
exactness when everything is selected, prefill == chunked prefill == token-by-token decode,
beam search, shared cache layout and size, plan validation, reload with remote code."""

import pytest
import torch
from remote_code import assert_reloads_without_hf_csa2
from tiny_models import ARCHS, VOCAB, tiny_model

from hf_csa2.metrics.kv_cache import (
    config_kv_elements_at_context,
    config_kv_elements_per_token,
    live_cache_elements,
    measure_kv_elements_per_token,
)
from hf_csa2.model import Csa2Config, Csa2FullAttention, Csa2ReaderAttention
from hf_csa2.model.indexer import Indexer
from hf_csa2.surgery.csa2 import assemble_csa2, csa2_layer_specs, dense_layer_specs
from hf_csa2.surgery.mla import apply_mla
from hf_csa2.surgery.plan import MlaPlan

QK_NORM = ("qwen3", "gemma3_text")
SLIDING = ("mistral", "gemma3_text")  # tiny sliding window 7
MIXED_PLAN = (["full", "reindex", "reuse", "swa", "reuse"], [None, 0, 1, None, 0])


def ids(batch=2, length=13, seed=0):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def calib(seed=1):
    return torch.randint(3, VOCAB, (4, 32), generator=torch.Generator().manual_seed(seed))


def csa2_model(arch, modes, sources, *, window=3, top_k=4, sinks=True, seed=0, sink_tokens=0, exact_window=False,
               lowrank_ranks=(6, 5), select_block=None):
    """Tiny source -> MLA (1/2-ish rank, 2 rope pairs) -> CSA2 with the given plan; indexers,
    readers and sinks randomised so that every term of every read is exercised."""
    src = tiny_model(arch, num_layers=len(modes))
    rope_key = "per_head" if arch in QK_NORM else "shared"
    mla, _ = apply_mla(src, MlaPlan(kv_lora_rank=6, qk_rope_head_dim=4, rope_key=rope_key), windows=calib())
    specs = csa2_layer_specs(
        mla.config.attention_layers, dense_layer_specs(src), modes, sources,
        window=window, top_k=top_k, index_heads=2, index_head_dim=8, index_rope_pairs=[0, 1], sinks=sinks,
        sink_tokens=sink_tokens, exact_window=exact_window, lowrank_ranks=lowrank_ranks, select_block=select_block,
    )
    model = assemble_csa2(src, mla, specs)
    model.config._attn_implementation = "eager"
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "sinks" in name or ".indexer." in name or ".reader." in name or "_down." in name or "_up." in name:
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 if "sinks" not in name else 1.0))
    return model.eval(), mla, src


# -- exactness -----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_full_layers_selecting_everything_equal_the_dense_latent_layers(arch):
    """K >= T: every earlier position is in Top-K or the window, so a full layer is its MLA layer."""
    length = 7 if arch in SLIDING else 13  # the MLA layers keep the source's sliding window (7)
    model, mla, _ = csa2_model(arch, ["full"] * 2, [None] * 2, top_k=length, sinks=False)
    x = ids(length=length)
    with torch.no_grad():
        for path in ("explicit", "absorbed"):
            mla.config.mla_attention_path = path
            assert (model(x).logits - mla(x).logits).abs().max() <= 1e-4
    assert all(isinstance(l.self_attn, Csa2FullAttention) for l in model.model.layers)


@pytest.mark.parametrize("arch", ARCHS)
def test_full_layers_with_an_exact_window_over_the_whole_prefix_are_the_source(arch):
    """exact_window: the last `window` positions are read from the layer's own exact keys and
    values; when the window covers the prefix nothing is read from the latent, so the model is
    its source (the latent window of the plain full layer is not: checked to differ)."""
    length = 7 if arch in SLIDING else 13
    model, _, src = csa2_model(arch, ["full"] * 2, [None] * 2, window=length, sinks=False, exact_window=True)
    latent, _, _ = csa2_model(arch, ["full"] * 2, [None] * 2, window=length, sinks=False)
    x = ids(length=length)
    with torch.no_grad():
        assert (model(x).logits - src(x).logits).abs().max() <= 1e-4
        assert (latent(x).logits - src(x).logits).abs().max() > 1e-2


@pytest.mark.parametrize("arch", SLIDING)
def test_swa_layer_with_the_source_window_equals_the_source(arch):
    src = tiny_model(arch)
    specs = csa2_layer_specs(dense_layer_specs(src), dense_layer_specs(src), ["swa", "swa"], [None, None],
                             window=7, top_k=1, index_heads=1, index_head_dim=2)
    if arch == "gemma3_text":  # layer 1 is a global layer there: keep it global-equivalent
        specs[1]["window"] = 64
    model = assemble_csa2(src, src, specs).eval()
    x = ids(length=20)
    with torch.no_grad():
        assert (model(x).logits - src(x).logits).abs().max() <= 1e-4


@pytest.mark.parametrize("exact_window", [False, True])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_read_paths_give_the_same_logits_for_every_mode(arch, exact_window):
    """csa2_read_path "scores" (full logits then pick) is the reference "gather" read, computed
    another way: same logits for a plan with every mode, prefill and decode."""
    model, _, _ = csa2_model(arch, *MIXED_PLAN, sink_tokens=2, exact_window=exact_window)
    x = ids(length=17)
    with torch.no_grad():
        model.config.csa2_read_path = "gather"
        gathered = model(x).logits
        model.config.csa2_read_path = "auto"
        auto = model(x).logits
        model.config.csa2_read_path = "scores"
        scored = model(x).logits
        decoded, _ = incremental_logits(model, x, [5, 1, 6, 5])
    assert torch.equal(auto, scored)  # on CPU, a store this short is read through "scores"
    assert (gathered - scored).abs().max() <= 1e-5 * (1 + gathered.abs().max())  # fp32 rounding scales with the logits
    assert (decoded - gathered).abs().max() <= 1e-4


def test_auto_read_path_picks_the_kernel_only_on_a_cuda_device_where_it_runs():
    from hf_csa2.model.sparse_attention import auto_read_path

    assert auto_read_path(torch.device("cuda", 0), fused_runs=True) == "triton"
    assert auto_read_path(torch.device("cuda", 0), fused_runs=False) == "gather"
    assert auto_read_path(torch.device("cpu"), fused_runs=True) == "gather"  # the interpreter is slower than torch
    # a short store (training and calibration windows) is one matmul; a long one is gathered
    assert auto_read_path(torch.device("cpu"), False, store_rows=512, index_width=384) == "scores"
    assert auto_read_path(torch.device("cpu"), False, store_rows=4 * 384, index_width=384) == "scores"
    assert auto_read_path(torch.device("cpu"), False, store_rows=4 * 384 + 1, index_width=384) == "gather"
    assert auto_read_path(torch.device("cuda", 0), True, store_rows=512, index_width=384) == "triton"
    assert make_config(base_specs()).csa2_read_path == "auto"


def test_unknown_read_path_is_refused_by_the_config():
    with pytest.raises(ValueError, match="csa2_read_path='dense'; allowed: auto, gather, scores, triton"):
        Csa2Config(**{**make_config(base_specs()).to_dict(), "csa2_read_path": "dense"})


# -- cache consistency ---------------------------------------------------------------------


def incremental_logits(model, x, chunks):
    out, cache, pos = [], None, 0
    for size in chunks:
        res = model(x[:, pos : pos + size], cache=cache, use_cache=True)
        cache = res.cache
        out.append(res.logits)
        pos += size
    assert pos == x.shape[1]
    return torch.cat(out, dim=1), cache


@pytest.mark.parametrize("exact_window", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_chunked_prefill_and_decode_agree_for_every_mode(arch, exact_window):
    model, _, _ = csa2_model(arch, *MIXED_PLAN, exact_window=exact_window)
    x = ids(length=17)
    with torch.no_grad():
        full = model(x).logits
        for chunks in ([17], [5, 1, 6, 5], [1] * 17, [9, 8]):
            got, cache = incremental_logits(model, x, chunks)
            assert (got - full).abs().max() <= 1e-4, chunks
    kinds = [type(layer).__name__ for layer in cache.layers]
    full = "DynamicIndexedWindowLayer" if exact_window else "PreallocatedIndexedLayer"
    assert kinds == [full] + ["PreallocatedSlidingWindowLayer"] * 4


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_sink_tokens_keep_prefill_chunked_prefill_and_decode_consistent(arch):
    """Window layers that also keep the first 2 tokens: same logits for every chunk schedule,
    and the live cache holds the window ring plus the sink tokens once they left the window."""
    model, _, _ = csa2_model(arch, *MIXED_PLAN, sink_tokens=2)
    x = ids(length=17)
    with torch.no_grad():
        full = model(x).logits
        for chunks in ([17], [5, 1, 6, 5], [1] * 17, [2, 1, 14]):
            got, cache = incremental_logits(model, x, chunks)
            assert (got - full).abs().max() <= 1e-4, chunks
        assert [type(layer).__name__ for layer in cache.layers][1:] == ["DynamicSinkWindowLayer"] * 4
        assert cache.layers[1].sink_keys.shape[-2] == 2 and cache.layers[1].keys.shape[-2] == 2  # P and W-1
        for n in (1, 3, 4, 9):
            cache = model(ids(batch=1, length=n), use_cache=True).cache
            assert live_cache_elements(cache) == config_kv_elements_at_context(model.config, n)
        without, _, _ = csa2_model(arch, *MIXED_PLAN, sink_tokens=0)
        assert (without(x).logits - full).abs().max() > 1e-3  # the sink tokens are really read


def test_swa_with_sink_tokens_is_streaming_attention():
    """swa with window W and P sink tokens = dense attention masked to the last W tokens plus
    the first P (StreamingLLM), computed by the source model with an explicit mask."""
    src = tiny_model("llama", num_layers=2)
    src.config._attn_implementation = "eager"
    specs = csa2_layer_specs(dense_layer_specs(src), dense_layer_specs(src), ["swa", "swa"], [None, None],
                             window=4, top_k=1, index_heads=1, index_head_dim=2, sink_tokens=3)
    model = assemble_csa2(src, src, specs).eval()
    x = ids(length=21)
    i = torch.arange(21)
    allow = (i[None, :] <= i[:, None]) & ((i[:, None] - i[None, :] < 4) | (i[None, :] < 3))
    mask = torch.zeros(21, 21).masked_fill(~allow, float("-inf"))[None, None].expand(2, 1, -1, -1)
    with torch.no_grad():
        assert (model(x).logits - src(x, attention_mask=mask).logits).abs().max() <= 1e-4


@pytest.mark.parametrize("sink_tokens", [0, 2])
def test_beam_search_and_greedy_generation_are_consistent_with_the_forward(sink_tokens):
    model, _, _ = csa2_model("llama", *MIXED_PLAN, sink_tokens=sink_tokens)
    x = ids(batch=1, length=9)
    with torch.no_grad():
        gen = model.generate(x, max_new_tokens=8, do_sample=False)
        # greedy = argmax of a plain forward over the generated prefix, step by step
        for t in range(x.shape[1], gen.shape[1]):
            assert model(gen[:, :t]).logits[0, -1].argmax() == gen[0, t]
        beams = model.generate(x, max_new_tokens=6, num_beams=3, do_sample=False, num_return_sequences=3,
                               output_scores=True, return_dict_in_generate=True)
        # each returned beam's score equals its length-normalised log-prob under a plain forward
        for seq, score in zip(beams.sequences, beams.sequences_scores):
            new = seq[x.shape[1]:]
            eos = (new == model.config.eos_token_id).nonzero()
            new = new[: int(eos[0]) + 1] if len(eos) else new  # a finished beam ends at its EOS
            logp = torch.log_softmax(model(seq[None, : x.shape[1] + len(new) - 1]).logits[0].float(), -1)
            total = logp[x.shape[1] - 1:].gather(1, new[:, None]).sum()
            assert torch.allclose(total / len(new), score, atol=1e-4)


@pytest.mark.parametrize(("sink_tokens", "exact_window"), [(0, False), (2, False), (0, True)])
def test_assisted_decoding_matches_greedy(sink_tokens, exact_window):
    """Prompt-lookup decoding records past window states and crops rejected drafts (sinks that
    left the window during a rejected draft go back into it): same tokens as plain greedy."""
    model, _, _ = csa2_model("llama", *MIXED_PLAN, sink_tokens=sink_tokens, exact_window=exact_window)
    x = torch.cat([ids(batch=1, length=6)] * 3, dim=1)  # repeats give the lookup drafts to try
    with torch.no_grad():
        greedy = model.generate(x, max_new_tokens=16, do_sample=False)
        assisted = model.generate(x, max_new_tokens=16, do_sample=False, prompt_lookup_num_tokens=4)
    assert torch.equal(greedy, assisted)


def test_top_k_smaller_than_history_really_drops_entries():
    """With K < history the read differs from reading everything: the index matters."""
    everything, _, _ = csa2_model("llama", *MIXED_PLAN, top_k=32)
    sparse, _, _ = csa2_model("llama", *MIXED_PLAN, top_k=2)
    x = ids(length=24)
    with torch.no_grad():
        assert (everything(x).logits - sparse(x).logits).abs().max() > 1e-3


# -- cache size ----------------------------------------------------------------------------


@pytest.mark.parametrize("exact_window", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
def test_live_cache_holds_shared_entries_once_and_window_rings(arch, exact_window):
    model, _, _ = csa2_model(arch, *MIXED_PLAN, window=3, exact_window=exact_window)
    specs = model.config.attention_layers
    per_token = config_kv_elements_per_token(model.config)
    # short prefill: every layer still holds every token
    assert measure_kv_elements_per_token(model) == per_token
    for n in (2, 9, 20):
        with torch.no_grad():
            cache = model(ids(batch=1, length=n), use_cache=True).cache
        assert live_cache_elements(cache) == config_kv_elements_at_context(model.config, n)
    full = specs[0]
    rope = 2 * sum(len(p) for p in full["rope_pairs"])
    scales = full["num_key_value_heads"] if arch in QK_NORM else 0
    entry = full["kv_lora_rank"] + rope + scales + full["index_head_dim"]
    rings = 5 if exact_window else 4  # 4 window layers (+ the full layer's exact-window ring)
    window_ring = rings * 2 * 2 * 12 * (3 - 1)  # x (K+V) x 2 KV heads x D=12 x (W-1) tokens
    assert config_kv_elements_at_context(model.config, 20) == 20 * entry + window_ring


# -- indexer ---------------------------------------------------------------------------------


def test_indexer_selects_the_top_scoring_older_positions():
    torch.manual_seed(0)
    idx = Indexer(16, num_heads=3, head_dim=4, rope_pairs=[], rotary_dim=8, with_key=True)
    h = torch.randn(2, 10, 16)
    keys = idx.keys(h, None)
    q, w = idx.queries(h, None)
    positions = torch.arange(10)
    top = idx.select(q, w, keys, positions, top_k=3, window=2, chunk=4)
    scores = idx.scores(q, w, keys)
    for b in range(2):
        for t in range(10):
            allowed = list(range(0, t - 2 + 1))
            want = sorted(allowed, key=lambda j: -scores[b, t, j].item())[:3]
            got = [j for j in top[b, t].tolist() if j >= 0]
            assert sorted(got) == sorted(want)
            assert len(got) == min(3, len(allowed))


# -- validation --------------------------------------------------------------------------------


def base_specs():
    full = {"kind": "csa2", "mode": "full", "num_key_value_heads": 2, "kv_lora_rank": 6, "rope_pairs": [[0, 1]],
            "window": 4, "top_k": 8, "index_heads": 2, "index_head_dim": 8}
    return [full, {"kind": "csa2", "mode": "reuse", "num_key_value_heads": 2, "source": 0, "window": 4}]


def make_config(specs):
    cfg = tiny_model("llama").config
    return Csa2Config.from_base_config(cfg, specs)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: s[1].update(source=1), "needs an earlier csa2 layer"),
        (lambda s: s[1].update(mode="reindex", top_k=4, index_heads=1, source=0, index_head_dim=4), "must equal layer 0"),
        (lambda s: s[1].update(window=2), "allowed: window >= 4"),
        (lambda s: s[0].update(top_k=0), "top_k=0 must be an integer >= 1"),
        (lambda s: s[0].update(window=0), "window=0 must be an integer >= 1"),
        (lambda s: s[1].update(mode="copy"), "allowed: swa, full, reindex, reuse"),
        (lambda s: s.__setitem__(0, {**s[0], "mode": "swa"}), "unknown keys"),
        (lambda s: s[0].update(index_rope_pairs=[0, 1, 2, 3, 4]), "index_rope_pairs"),
        (lambda s: s[0].update(select_block=3), r"select_block=3 does not divide top_k=8.*a divisor of 8 >= 2"),
        (lambda s: s[0].update(select_block=1), r"select_block=1 must be an integer >= 2"),
        (lambda s: s[1].update(select_block=2), "unknown keys"),  # a reuse layer reads its source's picks
    ],
)
def test_plan_validation_names_the_problem(edit, message):
    specs = base_specs()
    edit(specs)
    with pytest.raises(ValueError, match=message):
        make_config(specs)


def test_reuse_of_a_reindex_layer_reads_the_full_layers_entries():
    specs = base_specs()
    specs.insert(1, {"kind": "csa2", "mode": "reindex", "num_key_value_heads": 2, "source": 0, "window": 4,
                     "top_k": 4, "index_heads": 1})
    specs[2]["source"] = 1
    cfg = Csa2Config.from_base_config(tiny_model("llama", num_layers=3).config, specs)
    assert cfg.attention_layers[2]["entries"] == 0 and cfg.attention_layers[1]["index_head_dim"] == 8


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_block_selection_keeps_prefill_chunked_prefill_and_decode_consistent(arch):
    """Blocks of 2 (Top-4 = two whole blocks) in the full and reindex layers: every chunk
    schedule reads what the one-shot prefill reads, and the picks are whole blocks."""
    model, _, _ = csa2_model(arch, *MIXED_PLAN, select_block=2)
    specs = model.config.attention_layers
    assert [spec.get("select_block") for spec in specs] == [2, 2, None, None, None]
    x = ids(length=17)
    with torch.no_grad():
        full = model(x).logits
        for chunks in ([5, 1, 6, 5], [1] * 17):
            got, _ = incremental_logits(model, x, chunks)
            assert (got - full).abs().max() <= 1e-4, chunks
        token_level, _, _ = csa2_model(arch, *MIXED_PLAN)
        assert (token_level(x).logits - full).abs().max() > 1e-3  # the blocks change what is read
    top = model.model.layers[0].self_attn.scratch["top_k"]
    real = top[top >= 0]
    assert real.numel() and all((row[row >= 0] // 2).unique().numel() <= 2 for row in top.flatten(0, 1))


def test_a_plan_whose_block_does_not_divide_top_k_is_refused():
    from hf_csa2.surgery.plan import ConversionPlan, PlanError

    mla = {"kv_lora_rank": 64, "qk_rope_head_dim": 16}
    with pytest.raises(PlanError, match=r"csa2.select_block=48 does not divide csa2.top_k=256: .*a divisor of 256"):
        ConversionPlan.from_dict({"csa2": {"full_every": 2, "select_block": 48}, "mla": mla})
    assert ConversionPlan.from_dict({"csa2": {"full_every": 2, "select_block": 64}, "mla": mla}).csa2.select_block == 64


# -- reload ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
@pytest.mark.parametrize("exact_window", [False, True])
def test_reloads_without_hf_csa2(arch, exact_window, tmp_path):
    model, _, _ = csa2_model(arch, *MIXED_PLAN, exact_window=exact_window, select_block=2 if exact_window else None)
    with torch.no_grad():
        assert_reloads_without_hf_csa2(model, ids(batch=1, length=11), tmp_path)
    assert any(isinstance(l.self_attn, Csa2ReaderAttention) for l in model.model.layers)
