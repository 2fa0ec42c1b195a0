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
