"""The convert pipeline and CLI on tiny local checkpoints: outputs, reports, bad input."""

import json
import subprocess
import sys

import pytest
import torch
from folders import tree_digest
from tiny_models import save_tiny_source, tiny_tokenizer
from transformers import AutoModelForCausalLM

import hf_csa2
from hf_csa2.cli import main as cli_main
from hf_csa2.surgery.pipeline import OutputExistsError, convert
from hf_csa2.surgery.plan import PlanError
from hf_csa2.io.sources import SourceError

TEXT = " ".join(
    f"Section {i}: the parser reads token {i * 7 % 13} and writes value {i * 3 % 11} to the buffer."
    for i in range(400)
)


def calib_plan(**extra):
    return {"calibration": {"text": "TEXT", "num_tokens": 256, "seq_len": 64, "eval_windows": 2}, **extra}


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "calib.txt"
    path.write_text(TEXT)
    return path


def plan_with(text_file, **extra):
    plan = calib_plan(**extra)
    plan["calibration"]["text"] = str(text_file)
    return plan


def test_gqa_only_output_is_native_architecture(tmp_path, text_file):
    src = save_tiny_source("llama", tmp_path / "src")
    out = tmp_path / "out"
    result = convert(str(tmp_path / "src"), plan_with(text_file, gqa={"num_key_value_heads": 1}), out_dir=out, log=lambda m: None)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_key_value_heads"] == 1 and "auto_map" not in config
    report = json.loads((out / "conversion_report.json").read_text())
    assert [s["stage"] for s in report["stages"]] == ["source", "gqa"]
    assert report["stages"][0]["kv_elements_per_token"] == 2 * 2 * 12 * 2  # layers * kv * head_dim * (K,V)
    assert report["stages"][1]["kv_elements_per_token"] == 2 * 1 * 12 * 2
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.randint(4, 100, (1, 12))
    torch.testing.assert_close(reloaded(x).logits, result.model(x).logits, atol=1e-5, rtol=1e-5)
    del src


def test_gqa_with_kept_layers_is_an_hf_csa2_checkpoint_with_their_kv_heads(tmp_path, text_file):
    """A mixed plan (gqa.keep_layers) cannot be a native Llama (one KV head count for all
    layers): it is saved in the hf_csa2 format, loads by remote code, and its KV cost counts the
    kept layers at the source's heads."""
    save_tiny_source("llama", tmp_path / "src", num_layers=3)
    out = tmp_path / "out"
    plan = plan_with(text_file, gqa={"num_key_value_heads": 1, "keep_layers": [2]})
    result = convert(str(tmp_path / "src"), plan, out_dir=out, log=lambda m: None)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "hf_csa2" and "auto_map" in config
    assert [layer["num_key_value_heads"] for layer in config["attention_layers"]] == [1, 1, 2]
    report = json.loads((out / "conversion_report.json").read_text())
    assert report["stages"][1]["kv_elements_per_token"] == (1 + 1 + 2) * 12 * 2
    assert report["stages"][1]["notes"]["kept_layers"] == [2]
    reloaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    x = torch.randint(4, 100, (1, 12))
    torch.testing.assert_close(reloaded(x).logits, result.model(x).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text"])
def test_sinks_only_conversion_keeps_logits(tmp_path, text_file, arch):
    src = save_tiny_source(arch, tmp_path / "src")
    result = convert(str(tmp_path / "src"), plan_with(text_file, sinks={}), out_dir=tmp_path / "out", log=lambda m: None)
    x = torch.randint(4, 100, (2, 20))
    src.set_attn_implementation("sdpa")
    torch.testing.assert_close(result.model(x).logits, src(x).logits, atol=1e-5, rtol=1e-5)
    sinks = torch.cat([layer.self_attn.sinks for layer in result.model.model.layers])
    assert (sinks > -1e3).all(), "calibrated sinks must start in the trainable range, not at -1e4"
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "hf_csa2"


def test_existing_output_is_refused_and_untouched(tmp_path, text_file):
    save_tiny_source("llama", tmp_path / "src")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    before_src, before_out = tree_digest(tmp_path / "src"), tree_digest(out)
    with pytest.raises(OutputExistsError, match="--overwrite"):
        convert(str(tmp_path / "src"), plan_with(text_file, gqa={"num_key_value_heads": 1}), out_dir=out)
    assert tree_digest(out) == before_out and tree_digest(tmp_path / "src") == before_src


def test_overwrite_replaces_output_and_leaves_source_untouched(tmp_path, text_file):
    save_tiny_source("llama", tmp_path / "src")
    out = tmp_path / "out"
    out.mkdir()
    (out / "conversion_report.json").write_text("{}")  # an earlier hf-csa2 output: ours to replace
    (out / "old.txt").write_text("old")
    before_src = tree_digest(tmp_path / "src")
    convert(str(tmp_path / "src"), plan_with(text_file, gqa={"num_key_value_heads": 1}), out_dir=out, overwrite=True, log=lambda m: None)
    assert not (out / "old.txt").exists() and (out / "config.json").exists()
    assert tree_digest(tmp_path / "src") == before_src
    assert not list(tmp_path.glob(".out.*")), "no temp folders left behind"


def test_kv_heads_not_dividing_query_heads(tmp_path, text_file):
    save_tiny_source("llama", tmp_path / "src")  # 4 query heads
    with pytest.raises(PlanError, match=r"allowed: \[1, 2, 4\]"):
        convert(str(tmp_path / "src"), plan_with(text_file, gqa={"num_key_value_heads": 3}), out_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture(tmp_path, text_file):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=100)).save_pretrained(tmp_path / "gpt2")
    tiny_tokenizer().save_pretrained(tmp_path / "gpt2")
    with pytest.raises(SourceError, match="gpt2") as err:
        convert(str(tmp_path / "gpt2"), plan_with(text_file, sinks={}), out_dir=tmp_path / "out")
    assert "llama" in str(err.value)


def test_missing_files(tmp_path, text_file):
    with pytest.raises(SourceError, match="nope"):
        convert(str(tmp_path / "nope"), plan_with(text_file, sinks={}))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="config.json"):
        convert(str(tmp_path / "empty"), plan_with(text_file, sinks={}))


def test_unknown_alias():
    with pytest.raises(SourceError, match="smollm2-135m"):
        convert("smollm9-1t", {"sinks": {}})


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "hf_csa2.cli", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_cli_errors_are_one_clear_line(tmp_path, text_file):
    save_tiny_source("llama", tmp_path / "src")
    cases = [
        (["convert", "smollm9-1t", "--sinks", "--out", str(tmp_path / "o")], "smollm2-135m"),
        (["convert", str(tmp_path / "src"), "--to", "gqa", "--kv-heads", "3", "--calib-text", str(text_file), "--out", str(tmp_path / "o")], "allowed: [1, 2, 4]"),
        (["convert", str(tmp_path / "src"), "--to", "gqa", "--out", str(tmp_path / "o")], "--kv-heads"),
        (["convert", str(tmp_path / "src"), "--sinks", "--out", str(tmp_path / "src")], "is the source"),
        (["convert", str(tmp_path / "src"), "--plan", str(tmp_path / "none.yaml"), "--out", str(tmp_path / "o")], "does not exist"),
    ]
    for args, needle in cases:
        proc = run_cli(*args)
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        assert needle in proc.stderr, (needle, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()


def test_cli_convert_eval_inspect(tmp_path, text_file):
    save_tiny_source("mistral", tmp_path / "src")
    out = tmp_path / "out"
    code = cli_main(["convert", str(tmp_path / "src"), "--to", "gqa", "--kv-heads", "1", "--sinks",
                     "--calib-text", str(text_file), "--calib-tokens", "512", "--out", str(out)])
    assert code == 0
    assert json.loads((out / "config.json").read_text())["attention_layers"][0] == {"kind": "dense", "num_key_value_heads": 1, "sinks": True}
    proc = run_cli("eval", "ppl", str(tmp_path / "src"), str(out), "--text", str(text_file), "--window", "64",
                   "--max-windows", "3", "--json", str(tmp_path / "ppl.json"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads((tmp_path / "ppl.json").read_text())["results"]
    assert [r["tokens"] for r in results] == [3 * 63, 3 * 63] and results[0]["ratio"] == 1.0
    proc = run_cli("inspect", str(out), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    info = json.loads(proc.stdout)
    assert info["kv_elements_per_token_measured"] == info["kv_elements_per_token_config"] == 2 * 1 * 12 * 2
    assert hf_csa2.__version__


def test_distill_stage_after_mla_lowers_its_held_out_kl_and_is_reported(tmp_path, text_file):
    """A plan with mla + distill: the distill stage runs last, trains only attention parameters
    toward the source on windows that exclude the report's scoring windows, never ends worse on
    its held-out windows, and the saved checkpoint is the distilled model."""
    save_tiny_source("llama", tmp_path / "src")
    plan = plan_with(text_file, mla={"kv_lora_rank": 4, "qk_rope_head_dim": 4},
                     distill={"steps": 20, "lr": 3e-3, "num_tokens": 640, "holdout": 2, "every": 5})
    out = tmp_path / "out"
    result = convert(str(tmp_path / "src"), plan, out_dir=out, log=lambda m: None)
    stages = json.loads((out / "conversion_report.json").read_text())["stages"]
    assert [s["stage"] for s in stages] == ["source", "mla", "distill"]
    notes = stages[-1]["notes"]
    assert notes["windows"] == 10 and notes["trainable"] == "attention"
    # held-out KL falls by a margin (the keep rule alone would only give <=) and a trained state was kept
    assert notes["distill_heldout_kl_after"] < 0.95 * notes["distill_heldout_kl_before"], notes
    assert notes["distill_kept_step"] > 0
    from hf_csa2.io.sources import load_source

    reloaded = load_source(out).model
    x = torch.randint(4, 100, (1, 12))
    torch.testing.assert_close(reloaded(x).logits, result.model(x).logits, atol=1e-5, rtol=1e-5)


def test_calibration_windows_for_distill_exclude_the_scoring_windows(tmp_path, text_file):
    from hf_csa2.surgery.pipeline import prepare_source
    from hf_csa2.surgery.plan import ConversionPlan

    save_tiny_source("llama", tmp_path / "src")
    plan = ConversionPlan.from_dict(plan_with(text_file, sinks=True, distill={"num_tokens": 640, "holdout": 2}))
    calib = prepare_source(str(tmp_path / "src"), plan, log=lambda m: None).calib
    assert calib.fit.shape[0] == 4 and calib.score.shape[0] == 2 and calib.distill.shape[0] == 10
    assert torch.equal(calib.distill[:4], calib.fit)
    scored = {tuple(w.tolist()) for w in calib.score}
    assert not scored & {tuple(w.tolist()) for w in calib.distill}


def test_run_stages_stops_before_the_named_stage():
    """`hf-csa2 plan` searches on what the csa2 stage of `convert` gets: gqa and sinks applied."""
    from tiny_models import tiny_model

    from hf_csa2.surgery.pipeline import Calibration, run_stages
    from hf_csa2.surgery.plan import ConversionPlan

    torch.manual_seed(0)
    src = tiny_model("llama", num_layers=2)
    plan = ConversionPlan.from_dict({"gqa": {"num_key_value_heads": 1}, "sinks": {},
                                     "mla": {"kv_lora_rank": 8, "qk_rope_head_dim": 4},
                                     "csa2": {"full_every": 1, "window": 4, "top_k": 4}})
    ids = torch.randint(3, 100, (3, 24), generator=torch.Generator().manual_seed(1))
    seen = []
    model = run_stages(src, plan, Calibration(fit=ids[:2], score=ids[2:]), before="csa2",
                       on_stage=lambda name, m, t, notes: seen.append(name))
    assert seen == ["gqa", "sinks"]
    assert src.config.num_key_value_heads > 1
    assert [s["kind"] for s in model.config.attention_layers] == ["dense", "dense"]  # no csa2 yet
    assert all(s["num_key_value_heads"] == 1 and s["sinks"] for s in model.config.attention_layers)


@pytest.mark.slow
def test_distill_command_continues_a_converted_checkpoint(tmp_path, text_file):
    """`hf-csa2 distill` on a converted folder: uses the folder's plan for the windows, writes a
    new folder with the stage appended to the report, and never touches the converted folder."""
    save_tiny_source("llama", tmp_path / "src")
    conv = tmp_path / "conv"
    convert(str(tmp_path / "src"), plan_with(text_file, mla={"kv_lora_rank": 4, "qk_rope_head_dim": 4}), out_dir=conv,
            log=lambda m: None)
    before = tree_digest(conv)
    out = tmp_path / "more"
    code = cli_main(["distill", str(tmp_path / "src"), str(conv), "--steps", "10", "--lr", "3e-3", "--num-tokens", "640",
                     "--holdout", "2", "--every", "5", "--out", str(out)])
    assert code == 0
    assert tree_digest(conv) == before
    stages = json.loads((out / "conversion_report.json").read_text())["stages"]
    assert [s["stage"] for s in stages] == ["source", "mla", "distill"]
    notes = stages[-1]["notes"]
    assert notes["continued_from"] == str(conv) and notes["windows"] == 10
    assert notes["distill_heldout_kl_after"] < 0.95 * notes["distill_heldout_kl_before"], notes
    assert notes["distill_kept_step"] > 0
    assert "distill" in (out / "hf_csa2_plan.yaml").read_text()
    # bad input is refused before loading anything, with the allowed values
    proc = run_cli("distill", str(tmp_path / "src"), str(conv), "--steps", "0", "--out", str(tmp_path / "x"))
    assert proc.returncode == 2 and "--steps: 0; allowed: an integer >= 1" in proc.stderr
    proc = run_cli("distill", str(tmp_path / "src"), str(conv), "--out", str(conv), "--overwrite")
    assert proc.returncode == 2 and "is the converted checkpoint" in proc.stderr
    proc = run_cli("distill", str(tmp_path / "src"), str(tmp_path / "src"), "--out", str(tmp_path / "y"))
    assert proc.returncode == 2 and "hf_csa2_plan.yaml" in proc.stderr
    assert tree_digest(conv) == before
