"""End-to-end checks on the real SmolLM2-135M checkpoint and real text (skip if offline)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hf_csa2.metrics.kv_cache import measure_kv_elements_per_token
from hf_csa2.data.windows import token_windows
from hf_csa2.metrics.perplexity import mean_nll
from hf_csa2.surgery.gqa import apply_gqa
from hf_csa2.surgery.plan import GqaPlan
from hf_csa2.surgery.sinks import add_sinks, calibrate_sinks

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def texts(smollm2):
    from hf_csa2.data.corpus import CorpusError, resolve_text

    try:
        calib = token_windows(smollm2.tokenizer, resolve_text("python-docs:calib"), 256, 12)
        heldout = token_windows(smollm2.tokenizer, resolve_text("python-docs:heldout"), 256, 4)
    except CorpusError as err:
        pytest.skip(f"real text unavailable: {err}")
    return {"calib": calib, "heldout": heldout}


@pytest.fixture(scope="module")
def converted(smollm2, texts):
    """MQA (calibrated) + calibrated sinks, the full feature set of the Foundation issue."""
    mqa = apply_gqa(smollm2.model, GqaPlan(num_key_value_heads=1), windows=texts["calib"])[0]
    model = add_sinks(mqa)
    calibrate_sinks(model, texts["calib"][:2])
    return {"mqa": mqa, "model": model}


def test_sinks_alone_keep_the_logits(smollm2, texts):
    model = add_sinks(smollm2.model)
    calibrate_sinks(model, texts["calib"][:2])
    x = texts["heldout"][:2]
    torch.testing.assert_close(model(x).logits, smollm2.model(x).logits, atol=1e-5, rtol=0)


def test_calibrated_mqa_beats_mean_on_held_out_text(smollm2, texts, converted):
    mean = apply_gqa(smollm2.model, GqaPlan(num_key_value_heads=1, init="mean"))[0]
    calibrated = converted["mqa"]
    ppl = {name: mean_nll(m, texts["heldout"])["ppl"] for name, m in
           [("source", smollm2.model), ("mean", mean), ("calibrated", calibrated)]}
    assert ppl["calibrated"] < ppl["mean"], ppl
    assert ppl["source"] < ppl["calibrated"], ppl  # the conversion is lossy: no free lunch claimed


def test_live_cache_matches_config(converted):
    assert measure_kv_elements_per_token(converted["model"]) == 30 * 2 * 1 * 64


REMOTE = textwrap.dedent(
    """
    import sys, torch
    sys.modules["hf_csa2"] = None  # this process must not need hf_csa2
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
    tok = AutoTokenizer.from_pretrained(sys.argv[1])
    x = torch.load(sys.argv[2])
    prompt = tok("The Python tutorial explains", return_tensors="pt")
    gen = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    torch.save({"logits": model(x).logits, "text": tok.decode(gen[0])}, sys.argv[3])
    """
)


def test_round_trip_without_hf_csa2(smollm2, texts, converted, tmp_path):
    from hf_csa2.io.checkpoint import save_checkpoint

    model = converted["model"]
    save_checkpoint(model, smollm2.tokenizer, tmp_path / "ckpt")
    x = texts["heldout"][:1, :64]
    torch.save(x, tmp_path / "x.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(tmp_path / "modules")
    proc = subprocess.run([sys.executable, "-c", REMOTE, str(tmp_path / "ckpt"), str(tmp_path / "x.pt"), str(tmp_path / "o.pt")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "o.pt")
    assert (got["logits"] - model(x).logits).abs().max().item() <= 1e-5
    prompt = smollm2.tokenizer("The Python tutorial explains", return_tensors="pt")
    expected = smollm2.tokenizer.decode(model.generate(**prompt, max_new_tokens=12, do_sample=False)[0])
    assert got["text"] == expected


# -- MLA (issue "MLA surgery") ----------------------------------------------------------------


@pytest.fixture(scope="module")
def mla_quarter_fit(smollm2, texts):
    """A 1/4-budget MLA conversion (96 cache elements per token and layer: a 32-wide shared
    rope key + a 64-wide latent), calibrated on a small slice of text to keep the test short:
    (model, fit report)."""
    from hf_csa2.surgery.mla import apply_mla
    from hf_csa2.surgery.plan import MlaPlan

    return apply_mla(smollm2.model, MlaPlan(kv_lora_rank=64, qk_rope_head_dim=32, rope_key="shared"),
                     windows=texts["calib"][:6])


@pytest.fixture(scope="module")
def mla_quarter(mla_quarter_fit):
    return mla_quarter_fit[0]


def test_mla_full_rank_reproduces_smollm2(smollm2, texts):
    from hf_csa2.surgery.mla import apply_mla, full_stack_width
    from hf_csa2.surgery.plan import MlaPlan

    plan = MlaPlan(kv_lora_rank=full_stack_width(smollm2.model.config, 3, 32), qk_rope_head_dim=64, rope_key="per_head",
                   init="weight_svd")
    model, _ = apply_mla(smollm2.model, plan)
    x = texts["heldout"][:2]
    ref = smollm2.model(x).logits
    for path in ("explicit", "absorbed"):
        model.config.mla_attention_path = path
        # fp32 over 30 layers: 1e-4 absolute plus torch's default fp32 rtol on logits up to ~25
        torch.testing.assert_close(model(x).logits, ref, atol=1e-4, rtol=1e-5, msg=lambda m: f"{path}: {m}")


@pytest.mark.slow
def test_mla_absorbed_equals_explicit_and_generates_identically(mla_quarter, texts):
    x = texts["heldout"][:2]
    logits, gens = {}, {}
    for path in ("explicit", "absorbed"):
        mla_quarter.config.mla_attention_path = path
        logits[path] = mla_quarter(x).logits
        gens[path] = mla_quarter.generate(x[:1, :64], max_new_tokens=12, do_sample=False)
    mla_quarter.config.mla_attention_path = "auto"
    torch.testing.assert_close(logits["absorbed"], logits["explicit"], atol=1e-4, rtol=1e-5)
    assert torch.equal(gens["explicit"], gens["absorbed"])


def test_mla_cache_holds_only_latent_and_rope_key(mla_quarter):
    assert measure_kv_elements_per_token(mla_quarter) == 30 * (64 + 32)


def test_mla_activation_aware_beats_weight_svd_on_held_out_text(smollm2, texts, mla_quarter_fit):
    from hf_csa2.surgery.mla import apply_mla
    from hf_csa2.surgery.plan import MlaPlan

    mla_quarter, report = mla_quarter_fit
    plain, _ = apply_mla(smollm2.model, MlaPlan(kv_lora_rank=64, qk_rope_head_dim=32, rope_key="shared", init="weight_svd"),
                         splits=report.rope_splits)
    ppl = {name: mean_nll(m, texts["heldout"])["ppl"] for name, m in
           [("source", smollm2.model), ("aware", mla_quarter), ("plain", plain)]}
    assert ppl["source"] < ppl["aware"] < ppl["plain"], ppl


# -- CSA2 ---------------------------------------------------------------------------------


def csa2_from(dense, mla, modes, *, window, top_k):
    from hf_csa2.surgery.csa2 import assemble_csa2, csa2_layer_specs, default_sources, dense_layer_specs

    specs = csa2_layer_specs(mla.config.attention_layers, dense_layer_specs(dense), modes, default_sources(modes),
                             window=window, top_k=top_k, index_heads=3, index_head_dim=64,
                             index_rope_pairs=list(range(32)))
    return assemble_csa2(dense, mla, specs)


def test_csa2_full_layers_selecting_everything_equal_the_mla_model(mla_quarter, texts):
    """K >= T: a full layer reads every earlier entry (Top-K or window) -> the dense latent layer."""
    model = csa2_from(mla_quarter, mla_quarter, ["full"] * 30, window=16, top_k=256)
    x = texts["heldout"][:2]
    torch.testing.assert_close(model(x).logits, mla_quarter(x).logits, atol=1e-4, rtol=1e-5)


def _rms_norm_in_input_dtype(self, hidden_states):
    return self.weight * (hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True)
                                                      + self.variance_epsilon))


@pytest.mark.slow
def test_csa2_read_paths_and_padded_batches_agree_on_the_real_checkpoint(smollm2, mla_quarter, texts, monkeypatch):
    """The CPU path (``csa2_read_path: auto``: cut stores, one-matmul reads, caches appending in place,
    derived stores) against the reference read (``gather``): the same maths (fp64 logits equal to
    rounding), and in fp32 64 greedy tokens identical; a left-padded batch generates what each row
    generates alone. Top-K 128 + window 64 over at most 192 positions selects every earlier one, so
    no near-tie in a pick can make the runs differ. (In fp32 the logits of the two paths differ by up
    to ~1e-3 on this conversion: its reads amplify rounding, which fp64 shows to be rounding.)
    The RMSNorms (transformers' and the latent one) compute in fp32 whatever their input: in the fp64
    run they compute in fp64, or a 1e-16 difference between the paths that lands across an fp32
    rounding step becomes a 1e-7 one and grows through the layers (6e-6 seen on one machine, 0 on
    another); in fp64 throughout the paths differ by ~2e-12."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from hf_csa2.model.latent_attention import LatentRMSNorm

    modes = (["full", "reuse", "reindex", "reuse", "swa"] * 6)
    model = csa2_from(smollm2.model, mla_quarter, modes, window=64, top_k=128)
    x = texts["heldout"][:1, :192]
    prompt = x[:, :128]
    with torch.no_grad():
        model.double()
        exact = {}
        with monkeypatch.context() as patch:
            for norm in (LlamaRMSNorm, LatentRMSNorm):
                patch.setattr(norm, "forward", _rms_norm_in_input_dtype)
            for path in ("gather", "auto"):
                model.config.csa2_read_path = path
                exact[path] = model(x).logits
        model.float()
        tokens = {}
        for path in ("gather", "auto"):
            model.config.csa2_read_path = path
            tokens[path] = model.generate(prompt, max_new_tokens=64, do_sample=False, min_new_tokens=64)
        short = texts["heldout"][1:2, :100]
        batch = torch.cat([prompt, torch.cat([torch.full((1, 28), smollm2.tokenizer.eos_token_id), short], dim=1)])
        mask = torch.ones_like(batch)
        mask[1, :28] = 0
        together = model.generate(batch, attention_mask=mask, max_new_tokens=64, do_sample=False, min_new_tokens=64)
        alone = model.generate(short, max_new_tokens=64, do_sample=False, min_new_tokens=64)
    model.config.csa2_read_path = "auto"
    assert (exact["auto"] - exact["gather"]).abs().max() <= 1e-8
    assert torch.equal(tokens["auto"], tokens["gather"])
    assert torch.equal(together[0], tokens["auto"][0])
    assert torch.equal(together[1, 28:], alone[0])


@pytest.mark.slow
def test_csa2_prefill_chunked_prefill_and_decode_agree_at_2k_tokens(smollm2, mla_quarter):
    """Chunked prefill + decode reproduce one forward over 2K tokens when they make the same
    Top-K picks. Hard selection flips on near-ties when fp32 rounding differs between the
    two schedules, and a flip then spreads through later layers; so the chunked run replays
    the forward's picks (every cache read - shared entries, index keys, window rings, positions -
    is still its own), and separately the natural runs must agree up to their first flip."""
    from hf_csa2.data.corpus import resolve_text

    modes = (["full", "reuse", "reindex", "reuse", "swa"] * 6)
    model = csa2_from(smollm2.model, mla_quarter, modes, window=64, top_k=128)
    indexers = [l.self_attn.indexer for l, m in zip(model.model.layers, modes) if m in ("full", "reindex")]
    x = token_windows(smollm2.tokenizer, resolve_text("python-docs:heldout"), 2048, 1)
    recorded: dict[int, torch.Tensor] = {}

    def patched(k, original, replay):
        def select(queries, weights, keys, query_positions, top_k, window, **kw):
            if replay:
                return recorded[k][:, query_positions]
            picks = original(queries, weights, keys, query_positions, top_k, window, **kw)
            recorded[k] = picks
            return picks
        return select

    def run(chunks, replay):
        for k, ix in enumerate(indexers):
            ix.select = patched(k, type(ix).select.__get__(ix), replay)
        out, cache, pos = [], None, 0
        try:
            for size in chunks:
                res = model(x[:, pos : pos + size], cache=cache, use_cache=len(chunks) > 1)
                out.append(res.logits)
                cache, pos = res.cache, pos + size
        finally:
            for ix in indexers:
                del ix.select
        return torch.cat(out, dim=1)[0]

    schedule = [1000, 1, 600, 444, 1, 1, 1]
    with torch.no_grad():
        full = run([2048], replay=False)
        replayed = run(schedule, replay=True)
        natural = run(schedule, replay=False)
    # fp32 over 2K tokens and 30 layers; the fused SDPA kernel's blockwise softmax rounds the chunked and
    # the whole-prompt runs differently (1.2e-3 seen on logits of size ~10); a wrong cache read moves them by O(1)
    assert (replayed - full).abs().max() <= 2e-3
    assert torch.equal(replayed.argmax(-1), full.argmax(-1))
    # without replay: identical up to the first flip, which must not come early
    diff = (natural - full).abs().amax(-1)
    first = int((diff > 1e-3).nonzero()[0]) if (diff > 1e-3).any() else 2048
    assert first > 512, f"selection flipped already at query {first}"


def test_stage_report_answer_check_says_which_stage_loses_the_answers(smollm2, texts):
    """convert's stage report asks the answer check of the source and after every stage: one-shot MQA,
    which answers nothing about its prompt (docs/presets.md), says so in its own row, next to the source's
    score (which the source earns: 19-20 of 20 per depth in docs/presets.md)."""
    from hf_csa2.surgery.pipeline import convert

    plan = {"gqa": {"num_key_value_heads": 1},
            "calibration": {"text": "python-docs:calib", "num_tokens": 1024, "seq_len": 512, "eval_windows": 2,
                            "answer_probes": 4}}
    lines: list[str] = []
    report = convert("smollm2-135m", plan, log=lines.append).report
    checks = {r.stage: r.answer_check for r in report}
    assert list(checks) == ["source", "gqa"], checks
    source = checks["source"]
    assert source["per_depth"] == 4 and source["far"] + source["near"] >= 6, source
    assert checks["gqa"]["far"] + checks["gqa"]["near"] <= 2, checks
    stage_lines = [line for line in lines if line.startswith("[stage")]
    assert any("gqa" in line and f"far {checks['gqa']['far']}/4" in line for line in stage_lines), stage_lines


def test_teacher_answers_end_at_the_turns_end_and_batching_keeps_each_row(smollm2):
    """data.answers=teacher on the real template: generation stops at end of turn (no special
    tokens in the text), and a left-padded batch of prompts of different lengths answers each as alone."""
    from hf_csa2.train.teacher_answers import generate_answers

    asked = [[{"role": "user", "content": "Reply with one word: what colour is the sky on a clear day?"}],
             [{"role": "user", "content": "Name the capital of France."}]]
    together = generate_answers(smollm2.model, smollm2.tokenizer, asked, 24)
    alone = [generate_answers(smollm2.model, smollm2.tokenizer, [p], 24)[0] for p in asked]
    assert together == alone and all(together), together
    assert "blue" in together[0].lower() and "paris" in together[1].lower(), together
    assert not any("<|" in a for a in together)
