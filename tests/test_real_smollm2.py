"""End-to-end checks on the real SmolLM2-135M checkpoint and real text (skip if offline)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hf_csa2.evals.kv_cache import measure_kv_elements_per_token
from hf_csa2.evals.ppl import mean_nll, token_windows
from hf_csa2.surgery.gqa import apply_gqa
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
    mqa = apply_gqa(smollm2.model, 1, "calibrated", texts["calib"])
    model = add_sinks(mqa)
    calibrate_sinks(model, texts["calib"][:2])
    return {"mqa": mqa, "model": model}


def test_sinks_alone_keep_the_logits(smollm2, texts):
    model = add_sinks(smollm2.model)
    calibrate_sinks(model, texts["calib"][:2])
    x = texts["heldout"][:2]
    torch.testing.assert_close(model(x).logits, smollm2.model(x).logits, atol=1e-5, rtol=0)


def test_calibrated_mqa_beats_mean_on_held_out_text(smollm2, texts, converted):
    mean = apply_gqa(smollm2.model, 1, "mean")
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
    from hf_csa2.surgery.pipeline import save_checkpoint

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
def mla_quarter(smollm2, texts):
    """A 1/4-budget MLA conversion (96 cache elements per token and layer: a 32-wide shared
    rope key + a 64-wide latent), calibrated on a small slice of text to keep the test short."""
    from hf_csa2.surgery.mla import apply_mla

    return apply_mla(smollm2.model, 64, 16, windows=texts["calib"][:6], shared_rope_key=True)


def test_mla_full_rank_reproduces_smollm2(smollm2, texts):
    from hf_csa2.surgery.mla import apply_mla, full_stack_width

    model = apply_mla(smollm2.model, full_stack_width(smollm2.model.config, 3, 32), 32, factorisation="weight_svd")
    x = texts["heldout"][:2]
    ref = smollm2.model(x).logits
    for path in ("explicit", "absorbed"):
        model.config.mla_attention_path = path
        assert (model(x).logits - ref).abs().max() <= 1e-4, path


def test_mla_absorbed_equals_explicit_and_generates_identically(mla_quarter, texts):
    x = texts["heldout"][:2]
    logits, gens = {}, {}
    for path in ("explicit", "absorbed"):
        mla_quarter.config.mla_attention_path = path
        logits[path] = mla_quarter(x).logits
        gens[path] = mla_quarter.generate(x[:1, :64], max_new_tokens=12, do_sample=False)
    mla_quarter.config.mla_attention_path = "auto"
    assert (logits["explicit"] - logits["absorbed"]).abs().max() <= 1e-4
    assert torch.equal(gens["explicit"], gens["absorbed"])


def test_mla_cache_holds_only_latent_and_rope_key(mla_quarter):
    assert measure_kv_elements_per_token(mla_quarter) == 30 * (64 + 32)


def test_mla_activation_aware_beats_weight_svd_on_held_out_text(smollm2, texts, mla_quarter):
    from hf_csa2.surgery.mla import apply_mla

    plain = apply_mla(smollm2.model, 64, 16, factorisation="weight_svd", splits=mla_quarter.rope_splits,
                      shared_rope_key=True)
    ppl = {name: mean_nll(m, texts["heldout"])["ppl"] for name, m in
           [("source", smollm2.model), ("aware", mla_quarter), ("plain", plain)]}
    assert ppl["source"] < ppl["aware"] < ppl["plain"], ppl
