"""CSA2 surgery: layer plans, reader least squares, training-free indexer, the csa2 stage of
the convert pipeline on tiny checkpoints (every architecture), and plan validation."""

import json

import pytest
import torch
from remote_code import assert_reloads_without_hf_csa2
from tiny_models import ARCHS, VOCAB, save_tiny_source, tiny_model

from hf_csa2.cli import main as cli_main
from hf_csa2.evals.round_trip import round_trip
from hf_csa2.model import Csa2FullAttention, Csa2ReaderAttention
from hf_csa2.metrics.kv_cache import config_kv_elements_per_token
from hf_csa2.surgery.csa2 import apply_csa2, as_dense_csa2, fit_entry_reader, index_pair_energy
from hf_csa2.surgery.pipeline import convert
from hf_csa2.surgery.plan import ConversionPlan, Csa2Plan, MlaPlan, PlanError, default_sources

QK_NORM = ("qwen3", "gemma3_text")
MODES = ["full", "reuse", "reindex", "reuse", "swa"]
TEXT = " ".join(f"Record {i}: sensor {i % 17} reported value {i * 13 % 97} at step {i}." for i in range(500))


def windows(n=8, length=48, seed=1):
    return torch.randint(3, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


def tiny_plans(modes, **csa2):
    """The csa2 / mla sections these tests convert with (no indexer warm-up unless asked)."""
    return (Csa2Plan(layers=modes, **{"window": 4, "top_k": 8, "indexer_warmup_steps": 0, **csa2}),
            MlaPlan(kv_lora_rank=8, qk_rope_head_dim=4))


def convert_tiny(arch, modes=MODES, **csa2):
    """(source, CSA2 model, Csa2FitReport) of a tiny ``arch`` model with one layer per mode."""
    src = tiny_model(arch, num_layers=len(modes))
    plan, mla = tiny_plans(modes, **csa2)
    if arch in QK_NORM:
        mla = MlaPlan(kv_lora_rank=8, qk_rope_head_dim=4, rope_key="per_head")
    model, report = apply_csa2(src, plan, mla, windows=windows())
    return src, model, report


def test_default_sources_pick_the_nearest_earlier_layer():
    assert default_sources(["full", "reuse", "reindex", "reuse", "full", "reindex", "swa"]) == [None, 0, 0, 2, None, 4, None]
    with pytest.raises(ValueError, match="needs an earlier full layer"):
        default_sources(["reindex", "full"])


@pytest.mark.parametrize("arch", ARCHS)
def test_apply_csa2_builds_every_mode_and_fits_readers(arch):
    src, model, report = convert_tiny(arch)
    kinds = [type(l.self_attn) for l in model.model.layers]
    assert kinds == [Csa2FullAttention] + [Csa2ReaderAttention] * 4
    notes = report.layers
    assert notes[0].index_group in range(src.config.num_key_value_heads)
    for i in (1, 2, 3):  # readers fitted: better than reading nothing (relative error 1)
        assert notes[i].reader_key_rel_err < 1.0 and notes[i].reader_value_rel_err < 1.0
        assert notes[i].rel_err_after < notes[i].rel_err_before, notes[i]  # the refit must gain something
    # reindex starts from its source's index query: same selection as the layer it reindexes
    idx_full, idx_re = model.model.layers[0].self_attn.indexer, model.model.layers[2].self_attn.indexer
    assert torch.equal(idx_full.wq.weight, idx_re.wq.weight)
    x = windows(2, 40, seed=7)
    with torch.no_grad():
        loss = model(x, labels=x).loss
    assert torch.isfinite(loss)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_exact_window_full_layers_read_their_window_with_the_source_projections(arch):
    """csa2.exact_window: the full layer keeps the source's k/v projections for its window, its
    o_proj restarts from the source's and is refit to the new read (or stays the source's), and
    the model is closer to its source than with the window read from the latent."""
    modes = ["full", "reuse", "swa"]
    src, model, report = convert_tiny(arch, modes, exact_window=True)
    _, latent, _ = convert_tiny(arch, modes)
    _, unfit, _ = convert_tiny(arch, modes, exact_window=True, refit_output=False)
    attn, source = model.model.layers[0].self_attn, src.model.layers[0].self_attn
    assert attn.exact_window and not latent.model.layers[0].self_attn.exact_window
    for name in ("k_proj", "v_proj"):
        assert torch.equal(getattr(attn, name).weight, getattr(source, name).weight)
    assert report.layers[0].rel_err_after < report.layers[0].rel_err_before
    assert torch.equal(unfit.model.layers[0].self_attn.o_proj.weight, source.o_proj.weight)
    x = windows(2, 40, seed=7)
    with torch.no_grad():
        ref = src(x).logits
        assert (model(x).logits - ref).abs().mean() < (latent(x).logits - ref).abs().mean()


def test_reader_fit_is_exact_when_the_keys_are_a_linear_function_of_the_entries():
    """If the reading layer's own K/V are linear in the source latent, least squares recovers
    them: reader logits and values equal the layer's own (up to RoPE on the rope slots)."""
    src, model, report = convert_tiny("llama", modes=["full", "reuse"])
    full, reuse = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, 20, 48, generator=g)
    pos = torch.arange(20)[None].expand(3, -1)
    pe = model.model.rotary_emb(hidden, pos)
    with torch.no_grad():
        full.attention_output(hidden, pe)  # fills full.scratch with this batch's latent
        latent = full.scratch["latent"][:, 0]  # [3, 20, r]
        # make the reuse layer's own keys/values an exact linear function of the latent:
        # k = A c via k_proj = A W_DKV (no rope slots: coefficients must come out ~0)
        a = torch.randn(reuse.num_key_value_heads * 12, full.kv_lora_rank, generator=g)
        w_dkv = full.kv_a_proj.weight[: full.kv_lora_rank]
        reuse.k_proj.weight.copy_(a @ w_dkv)
        reuse.v_proj.weight.copy_(-a @ w_dkv)
        if full.kv_a_proj.bias is not None:
            reuse.k_proj.bias.copy_(a @ full.kv_a_proj.bias[: full.kv_lora_rank])
        notes = fit_entry_reader(reuse, hidden, ridge=1e-10)
    assert notes["reader_value_rel_err"] < 1e-8
    assert latent.shape[-1] == full.kv_lora_rank


def test_refined_entry_bias_never_reads_out_worse_and_switches_off_useless_readers():
    src, model, report = convert_tiny("llama", modes=["full", "reuse", "reuse"], refine_entry_bias=True, sink_tokens=2)
    for note in report.layers[1:]:
        assert note.readout_rel_err <= note.readout_rel_err_share + 1e-12
    # a reader whose values are noise: every head is better off not reading the entries
    from hf_csa2.surgery.csa2 import as_dense_csa2, entry_offset_readout, refine_entry_bias

    reuse, dense = model.model.layers[2].self_attn, as_dense_csa2(src).model.layers[2].self_attn
    hidden = torch.randn(2, 40, 48, generator=torch.Generator().manual_seed(5))
    pe = model.model.rotary_emb(hidden, torch.arange(40)[None].expand(2, -1))
    with torch.no_grad():
        model.model.layers[0].self_attn.attention_output(hidden, pe)  # entries of this batch
        readout, start = entry_offset_readout(reuse, hidden, pe), reuse.reader.logit_bias.clone()
        for off in (-3.0, 0.0, 1.5):  # the closed form the refinement scores = the layer's real read-out
            reuse.reader.logit_bias.copy_(start + off)
            real, _ = reuse.attention_output(hidden, pe)
            assert torch.allclose(readout(off).float().reshape(real.shape), real, atol=1e-5)
        w = reuse.reader.kv_b_proj.weight.view(reuse.num_key_value_heads, 2, reuse.head_dim, -1)  # [H, K|V, D, r]
        w[:, 1].normal_(0, 50.0, generator=torch.Generator().manual_seed(6))  # values: noise; keys kept
        reuse.reader.logit_bias.fill_(3.0)  # entries carry most of the attention
        notes = refine_entry_bias(reuse, dense, hidden, pe)
    assert notes["entry_heads_off"] == 1.0 and notes["readout_rel_err"] < notes["readout_rel_err_share"]


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_convert_pipeline_with_a_csa2_plan(tmp_path, arch, capsys, monkeypatch):
    save_tiny_source(arch, tmp_path / "src", num_layers=5)
    (tmp_path / "calib.txt").write_text(TEXT)
    plan = {
        "mla": {"kv_lora_rank": 8, "qk_rope_head_dim": 4, "rope_key": "per_head" if arch in QK_NORM else "shared"},
        "csa2": {"layers": MODES, "window": 4, "top_k": 8},
        "calibration": {"text": str(tmp_path / "calib.txt"), "num_tokens": 256, "seq_len": 64, "eval_windows": 2},
    }
    result = convert(str(tmp_path / "src"), plan, out_dir=tmp_path / "out", log=lambda m: None)
    report = json.loads((tmp_path / "out" / "conversion_report.json").read_text())
    assert [s["stage"] for s in report["stages"]] == ["source", "csa2"]  # MLA runs inside the csa2 stage
    notes = report["stages"][1]["notes"]
    assert notes["modes"] == "FURUS" and notes["reader_key_rel_err"] < 1.0
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert [s["mode"] for s in cfg["attention_layers"]] == MODES
    with torch.no_grad():
        assert_reloads_without_hf_csa2(result.model, torch.randint(4, 100, (1, 11)), tmp_path)
    if arch == "llama":  # the saved folder itself, as `python -m hf_csa2.evals.round_trip DIR` checks it
        monkeypatch.chdir(tmp_path)  # a relative folder, as on the command line
        checked = round_trip("out", torch.randint(4, 100, (1, 30)))
        assert checked["max_abs_logit_diff"] <= 1e-5 and checked["same_greedy"]
    capsys.readouterr()
    assert cli_main(["inspect", str(tmp_path / "out"), "--context", "40", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    # windowed layers hold W-1 = 3 tokens, full layers all 40: the live cache says the same
    assert info["kv_elements_per_token_at_context_measured"] == info["kv_elements_per_token_at_context_config"]
    assert info["kv_elements_per_token_at_context_measured"] < info["kv_elements_per_token_measured"]


@pytest.mark.parametrize(
    "csa2, message",
    [
        ({"full_every": 2, "layers": ["full"]}, "exactly one of layers"),
        ({"layers": ["full", "copy"]}, r"csa2.layers\[1\]='copy'.*allowed: a list of swa, full, reindex, reuse, lowrank"),
        ({"full_every": 2, "lowrank_key_rank": 0}, "csa2.lowrank_key_rank=0"),
        ({"full_every": 0}, "full_every=0"),
        ({"full_every": 2, "other_mode": "full"}, "other_mode"),
        ({"full_every": 2, "window": 0}, "csa2.window=0"),
        ({"full_every": 2, "top_k": -1}, "csa2.top_k=-1"),
        ({"full_every": 2, "sink_tokens": -1}, "csa2.sink_tokens=-1"),
    ],
)
def test_plan_errors_name_the_field(csa2, message):
    with pytest.raises(PlanError, match=message):
        ConversionPlan.from_dict({"mla": {"kv_lora_rank": 8, "qk_rope_head_dim": 4}, "csa2": csa2})


def test_csa2_plan_needs_mla_and_a_valid_layer_plan_for_the_model():
    with pytest.raises(PlanError, match="needs an mla section"):
        ConversionPlan.from_dict({"csa2": {"full_every": 2}})
    plan = ConversionPlan.from_dict({"mla": {"kv_lora_rank": 8, "qk_rope_head_dim": 4}, "csa2": {"layers": ["reuse", "full"]}})
    with pytest.raises(PlanError, match="needs an earlier full or reindex layer"):
        plan.validate_for(tiny_model("llama").config)
    plan = ConversionPlan.from_dict({"mla": {"kv_lora_rank": 8, "qk_rope_head_dim": 4}, "csa2": {"layers": ["full"]}})
    with pytest.raises(PlanError, match="the model has 2 layers"):
        plan.validate_for(tiny_model("llama").config)


def test_indexer_warm_up_lowers_the_kl_and_does_not_lose_recall():
    src, model, report = convert_tiny("llama", indexer_warmup_steps=60)
    for i in (0, 2):  # the full layer and the reindex layer
        notes = report.layers[i]
        assert notes.index_kl_after < notes.index_kl_before, notes
        assert notes.top_k_recall >= notes.top_k_recall_init - 0.02, notes
    assert all(p.requires_grad for p in model.parameters())  # training flags restored


def test_block_selection_from_the_plan_reaches_the_layers_and_the_recall_it_reports():
    """csa2.select_block: full and reindex layers select whole blocks, and the Top-K recall the fit
    reports is that of the blocks (another set than token-level Top-K's on the same indexer)."""
    _, model, report = convert_tiny("llama", select_block=4)
    _, _, token_report = convert_tiny("llama")
    assert [s.get("select_block") for s in model.config.attention_layers] == [4, None, 4, None, None]
    for i in (0, 2):
        blocks, tokens = report.layers[i].top_k_recall_init, token_report.layers[i].top_k_recall_init
        assert 0 < blocks <= 1 and blocks != tokens, (blocks, tokens)
    x = windows(2, 40, seed=7)
    with torch.no_grad():
        model(x)
    top = model.model.layers[0].self_attn.scratch["top_k"]
    assert all((row[row >= 0] // 4).unique().numel() <= 2 for row in top.flatten(0, 1))


def test_entry_mass_calibration_matches_the_dense_share_of_the_selected_positions():
    src, model, report = convert_tiny("llama")
    for i in (1, 2, 3):
        n = report.layers[i]
        assert abs(n.entry_share_after - n.entry_share_target) < 1e-3, n
    assert any(l.self_attn.reader.logit_bias.abs().max() > 0 for l in model.model.layers[1:4])


def test_calibration_windows_must_be_longer_than_the_csa2_window():
    with pytest.raises(PlanError, match="must exceed csa2.window=512"):
        ConversionPlan.from_dict({"mla": {"kv_lora_rank": 8, "qk_rope_head_dim": 4},
                                  "csa2": {"full_every": 2, "window": 512}, "calibration": {"seq_len": 512}})
    with pytest.raises(ValueError, match="longer than the layer's window"):
        apply_csa2(tiny_model("llama", num_layers=2), *tiny_plans(["full", "reuse"], window=48, indexer_warmup_steps=5),
                   windows=windows())


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_a_narrow_index_key_keeps_the_pairs_with_the_most_query_key_energy(arch):
    """index_head_dim < head width: the full layer caches a narrower index key, its RoPE pairs are
    the top pairs by E|q|^2 E|k|^2, and the training-free index rows are the source's query/key
    rows of those pairs (so each index head's dot product is that part of the attention logit)."""
    src, wide, _ = convert_tiny(arch, ["full", "reuse"])
    _, narrow, report = convert_tiny(arch, ["full", "reuse"], index_head_dim=4)
    spec = narrow.config.attention_layers[0]
    d = wide.config.attention_layers[0]["index_head_dim"]
    assert d == 12 and spec["index_head_dim"] == 4 and len(spec["index_rope_pairs"]) == 2
    # The pair energies recomputed here from the source's own projections (QK-norm applied where the
    # architecture has it), not through the function under test.
    attn0, seen = src.model.layers[0].self_attn, {}
    hooks = [attn0.register_forward_pre_hook(lambda m, a, kw: seen.update(x=kw["hidden_states"]), with_kwargs=True)]
    with torch.no_grad():
        src(windows()[:4])
    hooks[0].remove()
    x = seen["x"]
    q = attn0.q_proj(x).view(*x.shape[:2], -1, 12)
    k = attn0.k_proj(x).view(*x.shape[:2], -1, 12)
    if getattr(attn0, "q_norm", None) is not None:
        q, k = attn0.q_norm(q), attn0.k_norm(k)
    eq, ek = [(t[..., :6] ** 2 + t[..., 6:] ** 2).double().mean((0, 1)) for t in (q, k)]  # [heads, 6]
    energy = (eq * ek.repeat_interleave(eq.shape[0] // ek.shape[0], dim=0)).sum(0)
    assert torch.allclose(index_pair_energy(as_dense_csa2(src), windows()[:4], [0]), energy, rtol=1e-5)
    assert list(spec["index_rope_pairs"]) == sorted(torch.argsort(energy, descending=True)[:2].tolist())
    assert config_kv_elements_per_token(wide.config) - config_kv_elements_per_token(narrow.config) == d - 4
    attn, indexer = src.model.layers[0].self_attn, narrow.model.layers[0].self_attn.indexer
    group, per, half = report.layers[0].index_group, 4 // src.config.num_key_value_heads, 6
    dims = list(spec["index_rope_pairs"]) + [p + half for p in spec["index_rope_pairs"]]
    q_rows = attn.q_proj.weight.view(4, 12, -1)[group * per : (group + 1) * per, dims]
    k_rows = attn.k_proj.weight.view(-1, 12, 48)[group, dims]
    assert torch.equal(indexer.wq.weight, q_rows.reshape(per * 4, -1)) and torch.equal(indexer.wk.weight, k_rows)
    x = windows(1, 40, seed=5)
    with torch.no_grad():
        assert torch.isfinite(narrow(x, labels=x).loss)


def test_index_head_dim_is_checked_against_the_model():
    plan = ConversionPlan.from_dict({"mla": {"kv_lora_rank": 8, "qk_rope_head_dim": 4},
                                     "csa2": {"layers": ["full", "reuse"], "index_head_dim": 3}})
    with pytest.raises(PlanError, match=r"csa2.index_head_dim=3; allowed: an even number 2\.\."):
        plan.validate_for(tiny_model("llama").config)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3_text"])
def test_lowrank_layers_fit_codes_of_their_own_keys_and_values(arch):
    """A ``lowrank`` layer of a CSA2 plan: its codes fitted (error below reading nothing, and lower
    at a wider code), its o_proj refit, reuse layers still reading the full layer before it."""
    modes = ["full", "lowrank", "reuse", "swa", "lowrank"]
    errs, per_token = {}, {}
    for rank in (4, 16):
        src, model, report = convert_tiny(arch, modes, lowrank_key_rank=rank, lowrank_value_rank=rank)
        assert [type(l.self_attn).__name__ for l in model.model.layers] == [
            "Csa2FullAttention", "LowRankKVAttention", "Csa2ReaderAttention", "Csa2ReaderAttention", "LowRankKVAttention"]
        assert [s["kind"] for s in model.config.attention_layers] == ["csa2", "lowrank", "csa2", "csa2", "lowrank"]
        assert model.config.attention_layers[2]["source"] == 0
        assert report.stage_notes()["modes"] == "FLUSL"
        fit = report.layers[1]
        assert 0.0 < fit.lowrank_key_rel_err < 1.0 and 0.0 < fit.lowrank_value_rel_err < 1.0
        assert fit.rel_err_after < fit.rel_err_before
        errs[rank] = (fit.lowrank_key_rel_err, fit.lowrank_value_rel_err)
        per_token[rank] = config_kv_elements_per_token(model.config)
    assert errs[16][0] < errs[4][0] and errs[16][1] < errs[4][1]
    # the cache counts each lowrank layer's codes: 2 layers x (16 - 4) wider keys and values
    assert per_token[16] - per_token[4] == 2 * 2 * (16 - 4)


def test_lowrank_ranks_are_checked_against_the_model():
    plan = ConversionPlan.from_dict({"mla": {"kv_lora_rank": 8, "qk_rope_head_dim": 4},
                                     "csa2": {"layers": ["full", "lowrank"], "lowrank_key_rank": 8,
                                              "lowrank_value_rank": 25}})
    with pytest.raises(PlanError, match=r"csa2.lowrank_value_rank=25 exceeds a layer's key/value width 24 .*allowed: 1..24"):
        plan.validate_for(tiny_model("llama").config)


def test_a_plan_without_full_layers_needs_no_mla_section():
    plan = ConversionPlan.from_dict({"csa2": {"layers": ["swa", "lowrank", "swa"], "window": 4},
                                     "calibration": {"seq_len": 48}})
    assert plan.mla is None
    src = tiny_model("qwen3", num_layers=3)
    model, report = apply_csa2(src, plan.csa2, None, windows=windows())
    assert report.mla is None and report.stage_notes()["modes"] == "SLS"
    assert [type(l.self_attn).__name__ for l in model.model.layers] == [
        "Csa2ReaderAttention", "LowRankKVAttention", "Csa2ReaderAttention"]
    with pytest.raises(PlanError, match="csa2 needs an mla section"):
        ConversionPlan.from_dict({"csa2": {"layers": ["full", "lowrank"]}})


def test_lowrank_default_ranks_are_half_the_key_width_and_the_full_value_width():
    _, model, _ = convert_tiny("llama", ["full", "lowrank"])
    spec = model.config.attention_layers[1]
    assert (spec["key_rank"], spec["value_rank"]) == (12, 24)  # 2 KV heads x 12
