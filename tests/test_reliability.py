"""Hostile input, tried as a careless or hostile user would: nothing is lost, no code runs
unasked, incomplete checkpoints are refused, and every bad input is one line with exit 2.

Each test names the case of the reliability issue it covers; each failed on the code before
the fix (exit 0 with data lost, a traceback, or a silently wrong model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from tiny_models import save_tiny_source, tiny_model

from hf_csa2.cli import main as cli_main
from hf_csa2.io.output import OutputError
from hf_csa2.surgery.pipeline import convert

TEXT = " ".join(f"Entry {i}: the loader reads block {i * 7 % 13} and stores value {i * 3 % 11}." for i in range(600))


def tree_digest(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path -> bytes): equal digests = byte-identical trees."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text" / "calib.txt"
    path.parent.mkdir()
    path.write_text(TEXT)
    return path


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "models" / "src"
    save_tiny_source("llama", path)
    return path


def run(capsys, *args) -> tuple[int, str]:
    code = cli_main([str(a) for a in args])
    return code, capsys.readouterr().err


def assert_one_line_error(code: int, err: str, *words: str) -> None:
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("hf-csa2")]
    assert len(lines) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in lines[0], (word, lines[0])


def write_plan(tmp_path, data, name="plan.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def calibration(text_file, **extra):
    return {"text": str(text_file), "num_tokens": 256, "seq_len": 64, "eval_windows": 2, **extra}


@pytest.fixture
def converted(tmp_path, source, text_file):
    """A tiny hf_csa2 checkpoint (sinks: model_type hf_csa2, model code copied next to it)."""
    out = tmp_path / "models" / "conv"
    convert(str(source), {"sinks": {"init": "off"}, "calibration": calibration(text_file)}, out_dir=out, log=lambda m: None)
    return out


# -- 1. data loss ---------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["source", "parent", "symlink", "inside"])
def test_convert_never_overwrites_the_source_or_its_parent(capsys, tmp_path, source, text_file, where):
    (tmp_path / "models" / "other").mkdir()
    (tmp_path / "models" / "other" / "notes.txt").write_text("unrelated")
    before = tree_digest(tmp_path)
    out = {"source": source, "parent": source.parent, "inside": source / "converted",
           "symlink": tmp_path / "link"}[where]
    if where == "symlink":
        out.symlink_to(source, target_is_directory=True)
        before = tree_digest(tmp_path)
    code, err = run(capsys, "convert", source, "--to", "gqa", "--kv-heads", "1", "--calib-text", text_file,
                    "--out", out, "--overwrite")
    assert_one_line_error(code, err, "source")
    assert tree_digest(tmp_path) == before


def test_distill_never_overwrites_the_teacher(capsys, tmp_path, source, converted):
    before = tree_digest(tmp_path)
    code, err = run(capsys, "distill", source, converted, "--steps", "1", "--out", source, "--overwrite")
    assert_one_line_error(code, err, "is the source")
    assert tree_digest(tmp_path) == before


def test_overwrite_refuses_a_folder_hf_csa2_did_not_write(capsys, tmp_path, source, text_file):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    code, err = run(capsys, "convert", source, "--sinks", "--calib-text", text_file, "--out", out, "--overwrite")
    assert_one_line_error(code, err, "not written by hf-csa2")
    assert (out / "thesis.tex").read_text() == "years of work"


def test_output_checks_run_before_any_work(capsys, tmp_path, source, text_file, monkeypatch):
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    code, err = run(capsys, "convert", source, "--sinks", "--calib-text", text_file, "--out", ".", "--overwrite")
    assert_one_line_error(code, err, "current folder")
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    code, err = run(capsys, "convert", source, "--sinks", "--calib-text", text_file, "--out", blocker / "out")
    assert_one_line_error(code, err, "is a file, not a folder")
    code, err = run(capsys, "convert", source, "--sinks", "--calib-text", text_file, "--out", "/proc/hf-csa2-test/out")
    assert_one_line_error(code, err, "cannot create files in")


# -- 2. code runs unasked -------------------------------------------------------------------

def test_tokenizer_code_in_a_folder_is_never_run(capsys, tmp_path, converted):
    marker = tmp_path / "pwned"
    (converted / "evil_tokenizer.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import PreTrainedTokenizerFast\nclass EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    cfg = json.loads((converted / "tokenizer_config.json").read_text())
    cfg["auto_map"] = {"AutoTokenizer": [None, "evil_tokenizer.EvilTokenizer"]}
    (converted / "tokenizer_config.json").write_text(json.dumps(cfg))
    code, err = run(capsys, "inspect", converted)
    assert_one_line_error(code, err, "asks to run its own Python code", "evil_tokenizer.EvilTokenizer", "--trust-remote-code")
    assert not marker.exists()


def test_model_code_named_by_a_foreign_auto_map_is_refused(capsys, converted):
    cfg = json.loads((converted / "config.json").read_text())
    cfg["auto_map"]["AutoModelForCausalLM"] = "other_modeling.Model"
    (converted / "config.json").write_text(json.dumps(cfg))
    code, err = run(capsys, "inspect", converted)
    assert_one_line_error(code, err, "other_modeling.Model")


@pytest.mark.parametrize("auto_map", [["evil_tok.X", "evil_tok.X"], {"AutoTokenizer": "evil_tok.X"}])
def test_any_shape_of_tokenizer_auto_map_is_refused(capsys, source, auto_map):
    cfg = json.loads((source / "tokenizer_config.json").read_text())
    cfg["auto_map"] = auto_map
    (source / "tokenizer_config.json").write_text(json.dumps(cfg))
    code, err = run(capsys, "inspect", source)
    assert_one_line_error(code, err, "evil_tok.X")


def test_our_class_names_in_a_plain_llama_config_are_foreign(capsys, source):
    cfg = json.loads((source / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_hf_csa2.Csa2ForCausalLM"}
    (source / "config.json").write_text(json.dumps(cfg))
    code, err = run(capsys, "inspect", source)
    assert_one_line_error(code, err, "modeling_hf_csa2.Csa2ForCausalLM")


def test_our_own_checkpoint_loads_without_trust(capsys, converted):
    code, err = run(capsys, "inspect", converted, "--json")
    assert code == 0, err
    assert "trust" not in err


# -- 3. incomplete checkpoints --------------------------------------------------------------

@pytest.mark.parametrize("drop", ["model.layers.1.self_attn.q_proj.weight", "model.layers.0.self_attn.sinks"])
def test_a_checkpoint_missing_a_weight_is_refused(capsys, tmp_path, converted, text_file, drop):
    weights = load_file(converted / "model.safetensors")
    assert drop in weights
    del weights[drop]
    save_file(weights, converted / "model.safetensors", metadata={"format": "pt"})
    code, err = run(capsys, "inspect", converted)
    assert_one_line_error(code, err, "missing weights", drop)
    code, err = run(capsys, "eval", "ppl", converted, "--text", text_file, "--window", "64", "--max-windows", "1")
    assert_one_line_error(code, err, drop)


def test_an_unexpected_weight_is_refused(capsys, source):
    weights = load_file(source / "model.safetensors")
    weights["model.layers.0.self_attn.extra.weight"] = torch.zeros(2, 2)
    save_file(weights, source / "model.safetensors", metadata={"format": "pt"})
    code, err = run(capsys, "inspect", source)
    assert_one_line_error(code, err, "unexpected weights", "extra.weight")


# -- 4. and 5. plan values and bad files -------------------------------------------------------

BAD_PLANS = [
    ({"sinks": {"margin": float("nan")}}, "sinks.margin=nan"),
    ({"gqa": {"num_key_value_heads": 1, "refit_output": "false"}}, "gqa.refit_output='false'"),
    ({"gqa": {"num_key_value_heads": 1, "refit_output": "maybe"}}, "true or false"),
    ("gqa:\n  num_key_value_heads: 1\n  refit_output: 'no'\n", "gqa.refit_output='no'"),
    ("", "is empty"),
    ("# only a comment\n", "is empty"),
    ({"calibration": {"text": "python-docs:calib"}}, "no surgery section"),
    ({"mla": {"kv_lora_rank": 8, "qk_rope_head_dim": 4}, "csa2": {"layers": 7}}, "csa2.layers=7"),
    ({"mla": {"kv_lora_rank": 8, "qk_rope_head_dim": 4}, "csa2": {"layers": [["full"]]}}, "csa2.layers[0]"),
    ({"sinks": {}, "calibration": {"text": 12}}, "calibration.text=12"),
    ({"sinks": {"margin": "big"}}, "sinks.margin='big'"),
    ({"gqa": {"num_key_value_heads": 1, "ridge": float("inf")}}, "gqa.ridge=inf"),
    ({"sinks": {}, "distill": {"lr": float("nan")}}, "distill.lr=nan"),
    ({"mla": {"kv_lora_rank": 8, "qk_rope_head_dim": 4}, "csa2": {"full_every": 1, "top_k": 1e20}}, "csa2.top_k=1e+20"),
    ("sinks: {}\ncalibration:\n  seq_len: 1e11\n", "calibration.seq_len='1e11'"),
    ({"sinks": {}, "calibration": {"seq_len": 10 ** 11}}, "calibration.seq_len=100000000000"),
    ({"gqa": {"num_key_value_heads": 1}, "hsi": True}, "unknown key 'hsi'"),
]


@pytest.mark.parametrize("data, words", BAD_PLANS)
def test_bad_plans_are_one_line_before_loading(capsys, tmp_path, source, data, words):
    plan = write_plan(tmp_path, data)
    code, err = run(capsys, "convert", source, "--plan", plan, "--out", tmp_path / "out")
    assert_one_line_error(code, err, words)
    assert not (tmp_path / "out").exists()
    assert "Loading weights" not in err


def test_unreadable_plans_are_one_line(capsys, tmp_path, source):
    binary = tmp_path / "plan.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    code, err = run(capsys, "convert", source, "--plan", binary, "--out", tmp_path / "out")
    assert_one_line_error(code, err, "not UTF-8 text")
    code, err = run(capsys, "convert", source, "--plan", tmp_path, "--out", tmp_path / "out")
    assert_one_line_error(code, err, "is a folder")
    code, err = run(capsys, "convert", source, "--plan", write_plan(tmp_path, "gqa: [1,\n"), "--out", tmp_path / "out")
    assert_one_line_error(code, err, "not valid YAML")


def test_an_empty_calibration_text_is_one_line(capsys, tmp_path, source):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    code, err = run(capsys, "convert", source, "--sinks", "--calib-text", empty, "--out", tmp_path / "out")
    assert_one_line_error(code, err, "fewer than one window")
    assert not (tmp_path / "out").exists()


def test_broken_model_files_are_one_line(capsys, tmp_path, source, text_file):
    (source / "config.json").write_text("{not json")
    code, err = run(capsys, "convert", source, "--sinks", "--calib-text", text_file, "--out", tmp_path / "out")
    assert_one_line_error(code, err, "config.json")
    for name, payload in (("random.gguf", os.urandom(4096)), ("truncated.gguf", b"GGUF\x03\x00\x00\x00" + b"\x01" * 40)):
        path = tmp_path / name
        path.write_bytes(payload)
        code, err = run(capsys, "convert", path, "--sinks", "--calib-text", text_file, "--out", tmp_path / "out")
        assert_one_line_error(code, err, "GGUF", name)
        code, err = run(capsys, "inspect", path)
        assert_one_line_error(code, err, "GGUF", name)


@pytest.mark.parametrize("args, words", [
    (["inspect", "{src}", "--tokens", "0"], "--tokens: 0"),
    (["inspect", "{src}", "--context", "-4"], "--context: -4"),
    (["eval", "ppl", "{src}", "--text", "{text}", "--json", "{tmp}"], "is a folder"),
    (["eval", "ppl", "{src}", "--text", "{text}", "--json", "{src}/ppl.json"], "is inside the model"),
    (["eval", "ppl", "{src}", "--text", "{text}", "--window", "1"], "--window: 1"),
    (["eval", "needle", "{src}", "--out", "{src}"], "is the model"),
    (["distill", "{src}", "{src}", "--out", "{tmp}/d", "--lr", "nan"], "--lr: nan"),
    (["bench", "{src}", "--lengths", "0,4"], "--lengths"),
    (["eval", "lm", "{src}", "--tasks", "no_such_task"], "no such lm-eval task"),
    (["eval", "lm", "{src}", "--tasks", "hf_csa2_needle", "--metadata", "[1]"], "JSON object"),
    (["plan", "{src}", "--kv-budget", "1/2", "--plan", "{tmp}", "--out", "{tmp}/p.yaml"], "is a folder"),
    (["export", "{src}", "--format", "gguf", "--out", "{tmp}/e"], "allowed: deepseek_v3"),
])
def test_bad_arguments_are_one_line(capsys, tmp_path, source, text_file, args, words):
    fill = {"src": str(source), "text": str(text_file), "tmp": str(tmp_path)}
    before = tree_digest(source)
    code, err = run(capsys, *[a.format(**fill) for a in args])
    assert_one_line_error(code, err, words)
    assert tree_digest(source) == before


def test_a_bug_is_not_reported_as_bad_input(tmp_path, source, text_file, monkeypatch):
    import hf_csa2.evals.ppl as ppl

    def broken(*args, **kwargs):
        raise ValueError("an internal inconsistency")

    import hf_csa2.cli as cli

    monkeypatch.setattr(ppl, "compare_ppl", broken)  # a bug, not bad input: it must keep its traceback
    monkeypatch.setattr(cli, "compare_ppl", broken, raising=False)
    with pytest.raises(ValueError, match="internal inconsistency"):
        cli_main(["eval", "ppl", str(source), "--text", str(text_file), "--window", "64"])


def test_ctrl_c_is_one_line_exit_130_and_leaves_nothing(capsys, tmp_path, source, text_file, monkeypatch):
    import transformers

    out = tmp_path / "out"
    assert cli_main(["convert", str(source), "--sinks", "--calib-text", str(text_file), "--out", str(out)]) == 0
    before = tree_digest(out)
    original = transformers.PreTrainedModel.save_pretrained

    def interrupted(self, path, *args, **kwargs):
        original(self, path, *args, **kwargs)
        raise KeyboardInterrupt  # Ctrl-C in the middle of writing the replacement

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", interrupted)
    capsys.readouterr()
    code, err = run(capsys, "convert", source, "--sinks", "--calib-text", text_file, "--out", out, "--overwrite")
    assert code == 130 and err.strip().splitlines()[-1].startswith("hf-csa2: interrupted")
    assert "Traceback" not in err
    assert tree_digest(out) == before, "the earlier output is kept as it was"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out")) == []


# -- 6. temp folders of killed processes, permissions -----------------------------------------

def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_temp_folders_of_killed_processes_are_removed(tmp_path, source, text_file):
    import socket

    out = tmp_path / "out"
    stale = tmp_path / f".out.tmp-{dead_pid()}"  # a conversion killed (SIGKILL) while saving
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    alive = tmp_path / f".out.tmp-{os.getppid()}"  # a running process's temp folder is left alone
    alive.mkdir()
    elsewhere = tmp_path / f".out.tmp-otherhost-{dead_pid()}"  # another machine's pid means nothing here
    elsewhere.mkdir()
    convert(str(source), {"sinks": {"init": "off"}, "calibration": calibration(text_file)}, out_dir=out, log=lambda m: None)
    assert not stale.exists() and alive.exists() and elsewhere.exists() and (out / "config.json").exists()
    assert not [p for p in tmp_path.iterdir() if socket.gethostname()[:5] in p.name], "no temp folder of ours is left"


def test_an_output_moved_aside_by_a_killed_save_is_put_back(tmp_path):
    from hf_csa2.io.output import check_output_dir

    moved = tmp_path / f".other.old-{dead_pid()}"  # killed between the two renames: 'other' is missing
    moved.mkdir()
    (moved / "conversion_report.json").write_text("{}")
    with pytest.raises(OutputError, match="exists; pass --overwrite"):  # it is back, so it exists
        check_output_dir(tmp_path / "other", overwrite=False)
    assert (tmp_path / "other" / "conversion_report.json").exists() and not moved.exists()
    again = tmp_path / f".other.old-{dead_pid()}"  # the output exists too: the stale copy goes
    again.mkdir()
    check_output_dir(tmp_path / "other", overwrite=True)
    assert not again.exists() and (tmp_path / "other" / "conversion_report.json").exists()


def test_paths_are_normalised_before_they_are_checked(capsys, tmp_path, source, text_file):
    bar = tmp_path / "bar"
    bar.mkdir()
    (bar / "thesis.tex").write_text("years of work")
    code, err = run(capsys, "convert", source, "--sinks", "--calib-text", text_file,
                    "--out", f"{tmp_path}/missing/../bar")
    assert_one_line_error(code, err, "exists; pass --overwrite")
    assert (bar / "thesis.tex").read_text() == "years of work"
    link = tmp_path / "latest"
    link.symlink_to(tmp_path / "nowhere")
    code, err = run(capsys, "convert", source, "--sinks", "--calib-text", text_file, "--out", link)
    assert_one_line_error(code, err, "symbolic link")


def test_a_folder_that_appears_while_writing_is_not_replaced(tmp_path):
    from hf_csa2.io.output import OutputExistsError, write_folder_atomically

    out = tmp_path / "out"

    def write(tmp):
        out.mkdir()  # another run (or the user) creates it meanwhile
        (out / "notes.txt").write_text("theirs")
        (tmp / "conversion_report.json").write_text("{}")

    with pytest.raises(OutputExistsError):
        write_folder_atomically(out, write)
    assert (out / "notes.txt").read_text() == "theirs"
    with pytest.raises(OutputError, match="not written by hf-csa2"):
        write_folder_atomically(out, lambda tmp: None, overwrite=True)
    assert (out / "notes.txt").read_text() == "theirs"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_saved_files_have_normal_permissions(tmp_path, source, text_file):
    old = os.umask(0o022)
    try:
        out = tmp_path / "out"
        convert(str(source), {"sinks": {"init": "off"}, "calibration": calibration(text_file)}, out_dir=out,
                log=lambda m: None)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}, modes
    assert out.stat().st_mode & 0o777 == 0o755


def test_an_output_holding_an_input_is_refused(tmp_path):
    from hf_csa2.io.output import check_output_dir

    (tmp_path / "src").mkdir()
    with pytest.raises(OutputError, match="contains the source"):
        check_output_dir(tmp_path, overwrite=True, inputs=[("source", tmp_path / "src")])


# -- 7. KV elements per token at a stated context --------------------------------------------

@pytest.mark.parametrize("other_mode, sink_tokens", [("reuse", 0), ("swa", 2), ("reindex", 3)])
def test_stage_report_counts_kv_at_the_plan_context(tmp_path, source, text_file, other_mode, sink_tokens):
    from hf_csa2.metrics.kv_cache import measure_kv_elements_at_context

    plan = {"mla": {"kv_lora_rank": 8, "qk_rope_head_dim": 4},
            "csa2": {"full_every": 2, "window": 16, "top_k": 8, "indexer_warmup_steps": 0, "other_mode": other_mode,
                     "sink_tokens": sink_tokens},
            "calibration": calibration(text_file), "context": 200}
    result = convert(str(source), plan, log=lambda m: None)
    stage = result.report[-1]
    assert stage.kv_context == 200
    direct = measure_kv_elements_at_context(result.model, 200)  # a real 200-token prefill
    assert abs(stage.kv_elements_per_token - direct) < 1e-9
    assert abs(stage.kv_elements_per_token - stage.kv_elements_per_token_config) < 1e-9
    from hf_csa2.metrics.kv_cache import measure_kv_elements_per_token

    assert stage.kv_elements_per_token < measure_kv_elements_per_token(result.model)  # windows pay off with length


@pytest.mark.parametrize("arch", ["mistral", "gemma3_text", "llama"])
def test_kv_at_context_equals_a_real_prefill(arch):
    from hf_csa2.metrics.kv_cache import (
        measure_kv_elements_at_context,
        measure_kv_elements_per_token_at,
    )

    model = tiny_model(arch, num_layers=3)
    for context in (5, 40, 90):
        assert measure_kv_elements_per_token_at(model, context) == pytest.approx(
            measure_kv_elements_at_context(model, context), rel=1e-12)


# -- 8. padded batches on CSA2 layers ----------------------------------------------------------

def test_csa2_reads_padded_batches_as_each_row_alone(tmp_path, source, text_file):
    plan = {"mla": {"kv_lora_rank": 8, "qk_rope_head_dim": 4},
            "csa2": {"full_every": 2, "window": 16, "top_k": 8, "indexer_warmup_steps": 0},
            "calibration": calibration(text_file)}
    model = convert(str(source), plan, log=lambda m: None).model
    ids = torch.arange(4, 24).view(2, 10)
    padded = torch.ones_like(ids)
    padded[1, :3] = 0  # row 1 left-padded: its text is ids[1, 3:]
    with torch.no_grad():
        both = model(input_ids=ids, attention_mask=padded).logits
        alone = model(input_ids=ids[1:, 3:]).logits
        assert (both[1, 3:] - alone[0]).abs().max() < 1e-4
        generated = model.generate(input_ids=ids, attention_mask=padded, max_new_tokens=3, do_sample=False)
        single = model.generate(input_ids=ids[1:, 3:], max_new_tokens=3, do_sample=False)
    assert generated[1, 10:].tolist() == single[0, 7:].tolist()


def test_eval_lm_refuses_batches_for_first_token_windows_before_loading(capsys, tmp_path, source, text_file):
    code, err = run(capsys, "eval", "lm", f"window:16+4:{source}", "--tasks", "hf_csa2_needle", "--batch-size", "8")
    assert_one_line_error(code, err, "--batch-size 8", "sink_tokens", "allowed: --batch-size 1")
    assert "Loading weights" not in err
