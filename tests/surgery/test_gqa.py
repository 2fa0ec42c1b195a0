"""GQA/MQA merge maths: exactness, RoPE commutation, calibrated vs mean."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import ARCHS, VOCAB, tiny_model

from hf_csa2.model.attention_base import apply_rotary
from hf_csa2.surgery.calibration import attention_input_moments
from hf_csa2.surgery.gqa import AttentionWeights, apply_gqa, head_groups, merge_kv_heads
from hf_csa2.surgery.plan import GqaPlan


def calib_ids(n=6, t=32, seed=0):
    return torch.randint(3, VOCAB, (n, t), generator=torch.Generator().manual_seed(seed))


def test_head_groups_follow_floor_mapping():
    # 12 query heads, 4 old KV heads (3 q each) -> 3 new KV heads (4 q each)
    groups = head_groups(12, 4, 3)
    assert [[r for r, _ in g] for g in groups] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert all(j == r // 3 for g in groups for r, j in g)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("init", ["mean", "calibrated"])
def test_keeping_the_kv_head_count_is_exact(arch, init):
    src = tiny_model(arch)
    new, report = apply_gqa(src, GqaPlan(num_key_value_heads=src.config.num_key_value_heads, init=init), windows=calib_ids())
    assert len(report.layers) == src.config.num_hidden_layers
    assert all((f is None) == (init == "mean") for f in report.layers)
    x = calib_ids(2, 20, seed=3)
    torch.testing.assert_close(new(x).logits, src(x).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_mean_merge_is_ainslie_mean_pooling(arch):
    src = tiny_model(arch)  # 4 query heads, 2 KV heads
    new = apply_gqa(src, GqaPlan(num_key_value_heads=1, init="mean"))[0]
    old_k = src.model.layers[0].self_attn.k_proj.weight.view(2, 12, -1)
    torch.testing.assert_close(new.model.layers[0].self_attn.k_proj.weight, old_k.mean(0))
    torch.testing.assert_close(new.model.layers[0].self_attn.q_proj.weight, src.model.layers[0].self_attn.q_proj.weight)


def kl_to_source(src, new, x):
    a, b = src(x).logits.log_softmax(-1), new(x).logits.log_softmax(-1)
    return torch.nn.functional.kl_div(b, a, log_target=True, reduction="batchmean").item()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_calibrated_beats_mean_on_tiny_models(arch):
    src = tiny_model(arch)
    ids = calib_ids(16, 48)
    mean = apply_gqa(src, GqaPlan(num_key_value_heads=1, init="mean"))[0]
    merge_only, merge_report = apply_gqa(src, GqaPlan(num_key_value_heads=1, refit_output=False), windows=ids)
    calibrated, report = apply_gqa(src, GqaPlan(num_key_value_heads=1), windows=ids)
    held_out = calib_ids(4, 48, seed=11)
    kl = {name: kl_to_source(src, m, held_out) for name, m in [("mean", mean), ("merge", merge_only), ("refit", calibrated)]}
    assert kl["merge"] < kl["mean"] and kl["refit"] < kl["mean"], kl
    fits = report.layers
    # the ridge pulls toward the merged o_proj, so "no worse" holds by construction: ask for a real gain
    assert all(f.rel_err_after < 0.9 * f.rel_err_before for f in fits), fits
    assert merge_report.layers == [None] * len(fits)
    notes = report.stage_notes()
    assert notes["attn_out_rel_err_after_refit"] == pytest.approx(sum(f.rel_err_after for f in fits) / len(fits))
    assert "keys" not in notes  # llama/qwen2/mistral have no QK-norm: the RoPE-aware key merge ran


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_refinement_after_the_merge_lowers_held_out_error_and_moves_logits_toward_the_source(arch):
    """``refine_steps``: Adam on each layer's output error after the merge and refit. The kept
    state is the best on held-out calibration windows, so strictly lower there means real
    steps were taken; logits on windows the conversion never saw move toward the source too.
    Qwen3 runs the QK-norm path, whose keys the closed form can only mean-merge."""
    src = tiny_model(arch)
    fit = calib_ids(40, 48, seed=2)
    unseen = calib_ids(4, 48, seed=12)
    plain, _ = apply_gqa(src, GqaPlan(num_key_value_heads=1), windows=fit)
    refined, report = apply_gqa(src, GqaPlan(num_key_value_heads=1, refine_steps=60, refine_lr=1e-3), windows=fit)
    layers = report.layers
    assert all(f.refine_heldout_err_after <= f.refine_heldout_err_before for f in layers), layers
    assert sum(f.refine_heldout_err_after for f in layers) < sum(f.refine_heldout_err_before for f in layers), layers
    assert any(f.refine_kept_step > 0 for f in layers)
    notes = report.stage_notes()
    assert notes["refine_heldout_err_after"] == pytest.approx(sum(f.refine_heldout_err_after for f in layers) / len(layers))
    assert kl_to_source(src, refined, unseen) < kl_to_source(src, plain, unseen)
    assert refined.model.layers[0].self_attn.k_proj.weight.shape[0] == 12  # still one KV head
    assert all(p.grad is None for p in refined.parameters())


def test_one_shot_merge_from_source_moments_beats_mean():
    """merge_kv_heads alone (no layerwise pass, no refit) already beats mean pooling."""
    src = tiny_model("llama")
    moments = attention_input_moments(src, calib_ids(16, 48))
    held_out = calib_ids(4, 48, seed=11)
    errs = {}
    for method in ("mean", "calibrated"):
        state = dict(src.state_dict())
        for i, layer in enumerate(src.model.layers):
            merged = merge_kv_heads(AttentionWeights.from_module(layer.self_attn), num_q_heads=4, old_kv_heads=2,
                                    new_kv_heads=1, head_dim=12, method=method, moment=moments[i])
            state.update(merged.state_dict(f"model.layers.{i}.self_attn."))
        model = apply_gqa(src, GqaPlan(num_key_value_heads=1, init="mean"))[0]
        model.load_state_dict(state)
        errs[method] = kl_to_source(src, model, held_out)
    assert errs["calibrated"] < errs["mean"], errs


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), p=st.integers(0, 200), t=st.integers(0, 200))
def test_rope_aware_fold_is_exact_when_heads_are_complex_multiples(seed, p, t):
    """If old keys are per-frequency complex multiples of one key, the calibrated merge
    preserves every query-key score at every pair of positions (RoPE commutes with the fold)."""
    g = torch.Generator().manual_seed(seed)
    d_model, D, hq = 10, 8, 4
    base = torch.randn(D, d_model, generator=g, dtype=torch.float64)
    k_heads = []
    for _ in range(2):
        c = torch.complex(torch.randn(D // 2, generator=g, dtype=torch.float64), torch.randn(D // 2, generator=g, dtype=torch.float64))
        z = torch.complex(base[: D // 2], base[D // 2 :]) * c[:, None]
        k_heads.append(torch.cat([z.real, z.imag]))
    w = AttentionWeights(
        q_w=torch.randn(hq * D, d_model, generator=g, dtype=torch.float64),
        k_w=torch.cat(k_heads), v_w=torch.randn(2 * D, d_model, generator=g, dtype=torch.float64),
        o_w=torch.randn(d_model, hq * D, generator=g, dtype=torch.float64),
    )
    x = torch.randn(64, d_model, generator=g, dtype=torch.float64)
    xa = torch.cat([x, torch.ones(64, 1, dtype=torch.float64)], 1)
    merged = merge_kv_heads(w, num_q_heads=hq, old_kv_heads=2, new_kv_heads=1, head_dim=D,
                            method="calibrated", moment=xa.T @ xa / 64)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))

    def rope(vec, pos):
        ang = pos * inv_freq
        cos, sin = torch.cat([ang.cos(), ang.cos()]), torch.cat([ang.sin(), ang.sin()])
        out, _ = apply_rotary(vec[None, None, None], vec[None, None, None], cos[None, None], sin[None, None])
        return out[0, 0, 0]

    xq, xk = x[0], x[1]
    for r in range(hq):
        q_old = w.q_w[r * D : (r + 1) * D] @ xq
        k_old = w.k_w[(r // 2) * D : (r // 2 + 1) * D] @ xk
        q_new = merged.q_w[r * D : (r + 1) * D] @ xq
        k_new = merged.k_w @ xk
        s_old = rope(q_old, p) @ rope(k_old, t)
        s_new = rope(q_new, p) @ rope(k_new, t)
        assert abs(s_old - s_new) < 1e-8 * (1 + abs(s_old))


@pytest.mark.parametrize("arch", ARCHS)
def test_kept_layers_stay_the_source_and_the_others_merge(arch):
    """``keep_layers``: those layers keep the source's KV heads and weights exactly; the others
    are merged as in a plain conversion. Keeping every layer reproduces the source."""
    src = tiny_model(arch, num_layers=3)
    ids, x = calib_ids(8, 32), calib_ids(2, 20, seed=3)
    kv = src.config.num_key_value_heads
    mixed, report = apply_gqa(src, GqaPlan(num_key_value_heads=1, keep_layers=[1]), windows=ids)
    assert [spec["num_key_value_heads"] for spec in mixed.config.attention_layers] == [1, kv, 1]
    assert report.layers[1] is None and report.layers[0] is not None and report.stage_notes()["kept_layers"] == [1]
    kept, source = mixed.model.layers[1].self_attn.state_dict(), src.model.layers[1].self_attn.state_dict()
    assert kept.keys() == source.keys()
    for name in source:
        torch.testing.assert_close(kept[name], source[name], atol=0, rtol=0)
    assert mixed.model.layers[0].self_attn.k_proj.weight.shape[0] == 12  # one KV head of head_dim 12
    everything, _ = apply_gqa(src, GqaPlan(num_key_value_heads=1, keep_layers=[0, 1, 2]), windows=ids)
    torch.testing.assert_close(everything(x).logits, src(x).logits, atol=1e-5, rtol=1e-5)


def test_keep_layers_are_checked():
    from hf_csa2.surgery.plan import ConversionPlan, PlanError

    with pytest.raises(PlanError, match=r"repeats layer\(s\) \[2\]"):
        ConversionPlan.from_dict({"gqa": {"num_key_value_heads": 1, "keep_layers": [2, 0, 2]}})
    with pytest.raises(PlanError, match="cannot be combined with mla or csa2"):
        ConversionPlan.from_dict({"gqa": {"num_key_value_heads": 1, "keep_layers": [0]},
                                  "mla": {"kv_lora_rank": 8, "qk_rope_head_dim": 4}})
    plan = ConversionPlan.from_dict({"gqa": {"num_key_value_heads": 1, "keep_layers": [0, 3]}})
    with pytest.raises(PlanError, match=r"gqa.keep_layers names layer 3; the model has 2 layers; allowed: 0..1"):
        plan.validate_for(tiny_model("llama").config)
