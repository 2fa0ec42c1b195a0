"""The restored-layer scan: a layer given its source attention back runs exactly the source's
computation there, the converted model is put back afterwards, and the scan ranks layers by
how much their restoration lowers the answer NLL."""

import json

import pytest
import torch

from hf_csa2.metrics.answer_check import make_probes
from hf_csa2.metrics.restored_layers import restored_attention, scan_restored_layers
from hf_csa2.surgery.gqa import apply_gqa
from hf_csa2.surgery.plan import GqaPlan
from tests.tiny_models import VOCAB, tiny_model, tiny_tokenizer


def probes_for(tok, n=2, t=300, distractors=2):
    text = "Plain filler sentences about rivers, bread and weather fill the page. " * 40
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"][: n * t]).view(n, t)
    return make_probes(tok, ids, per_depth=2, distractors=distractors)


@pytest.fixture
def models():
    tok = tiny_tokenizer()
    src = tiny_model("llama", num_layers=3)
    calib = torch.randint(4, VOCAB, (6, 32), generator=torch.Generator().manual_seed(0))
    # layers 0 and 2 merged to MQA, layer 1 kept: restoring layer 1 changes nothing
    converted, _ = apply_gqa(src, GqaPlan(num_key_value_heads=1, keep_layers=[1]), windows=calib)
    return tok, src, converted.eval()


def test_restoring_every_converted_layer_gives_the_source_back_and_the_block_undoes_it(models):
    _, src, converted = models
    x = torch.randint(4, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))
    before = converted(x).logits
    assert (before - src(x).logits).abs().max() > 1e-3  # the merge changed something
    with restored_attention(converted, src, [0, 2]):
        torch.testing.assert_close(converted(x).logits, src(x).logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(converted(x).logits, before, atol=0, rtol=0)
    with pytest.raises(RuntimeError, match="inside"):
        with restored_attention(converted, src, [0]):
            raise RuntimeError("inside")
    torch.testing.assert_close(converted(x).logits, before, atol=0, rtol=0)  # put back on errors too


def test_the_scan_ranks_layers_by_answer_nll_gain(models):
    tok, src, converted = models
    probes = probes_for(tok)
    scan = scan_restored_layers(src, converted, probes)
    assert sorted(scan.restored) == [0, 1, 2]
    # layer 1 was never converted: restoring it is the converted model itself
    assert scan.gain(1) == pytest.approx(0.0, abs=1e-6)
    assert scan.restored[1].answer_nll == pytest.approx(scan.converted.answer_nll, abs=1e-6)
    gains = [scan.gain(i) for i in scan.ranked()]
    assert gains == sorted(gains, reverse=True)
    table = scan.table()
    assert table.splitlines()[2].startswith("| source |") and "| converted, layer 0 restored |" in table
    doc = scan.as_dict()
    assert json.loads(json.dumps(doc))["ranked"] == scan.ranked()
    with pytest.raises(ValueError, match="no probes"):
        scan_restored_layers(src, converted, [])
    with pytest.raises(ValueError, match="the converted model has 3 layers, the source 2"):
        with restored_attention(converted, tiny_model("llama"), [0]):
            pass


def test_cli_eval_restore_layers(tmp_path, capsys):
    from hf_csa2.cli import main
    from hf_csa2.surgery.pipeline import convert
    from tests.tiny_models import save_tiny_source

    save_tiny_source("llama", tmp_path / "src", num_layers=2)
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 300)
    plan = {"gqa": {"num_key_value_heads": 1},
            "calibration": {"text": str(text), "num_tokens": 256, "seq_len": 64, "eval_windows": 1, "answer_probes": 0}}
    convert(str(tmp_path / "src"), plan, out_dir=tmp_path / "mqa", log=lambda m: None)
    out = tmp_path / "scan.json"
    args = ["eval", "restore-layers", str(tmp_path / "src"), str(tmp_path / "mqa"), "--text", str(text), "--context",
            "300", "--per-depth", "2", "--windows", "2", "--distractors", "2"]
    assert main(args + ["--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert sorted(doc["scan"]["restored"]) == ["0", "1"] and doc["distractors"] == 2
    assert "| converted, layer" in capsys.readouterr().out
    assert main(args + ["--distractors", "-1"]) == 2
    assert "--distractors -1; allowed: an integer >= 0" in capsys.readouterr().err
    assert main(args[:6] + ["--context", "40", "--per-depth", "2"]) == 2  # too short for a probe
    assert "--context 40" in capsys.readouterr().err
