"""The retrieval-layer scan: cutting a layer to a window hides exactly what lies beyond it, and on
the real SmolLM2 the scan finds the layer that reads far facts back (measured by hand before:
docs/results.md, "SmolLM2-135M: which layers read the far facts")."""

import pytest
import torch

from hf_csa2.metrics.answer_check import make_probes
from hf_csa2.metrics.retrieval_layers import RetrievalScan, scan_retrieval_layers, windowed_attention
from hf_csa2.metrics.answer_check import AnswerCheck
from tests.tiny_models import ARCHS, tiny_model


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_windowed_layer_no_longer_sees_tokens_beyond_its_window(arch, impl):
    model = tiny_model(arch)  # 2 layers; mistral / gemma3 sliding windows of 7
    model.config._attn_implementation = impl
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[0, 31] = (ids[0, 31] + 1 - 3) % 125 + 3  # 8 tokens before the last query

    def last_logits(x):
        with torch.no_grad():
            return model(x).logits[0, -1]

    base = last_logits(ids)
    assert not torch.allclose(base, last_logits(changed), atol=1e-6)  # the model reads it
    with windowed_attention(model, [0, 1], window=3):  # two layers reach 2 + 2 tokens back
        assert torch.allclose(last_logits(ids), last_logits(changed), atol=1e-6)
        cut = last_logits(ids)
    with windowed_attention(model, [0], window=3):  # the other layer still reaches it
        assert not torch.allclose(last_logits(ids), last_logits(changed), atol=1e-6)
    with windowed_attention(model, [0, 1], window=40):  # a window over everything changes nothing
        assert torch.allclose(last_logits(ids), base, atol=1e-5)
    assert torch.allclose(last_logits(ids), base) and not torch.allclose(cut, base, atol=1e-4)  # hooks removed


def test_retrieval_layers_are_those_whose_cut_loses_enough_far_answers():
    source = AnswerCheck(far=6, near=0, per_depth=6, answer_nll=0.1, context=512)
    scan = RetrievalScan(window=128, drop=0.5, source=source, far={3: 6, 4: 3, 5: 4, 6: 0})
    assert scan.retrieval_layers == [4, 6]
    assert "| 6 | 0/6 | yes |" in scan.table() and "| 5 | 4/6 |  |" in scan.table()
    nothing = RetrievalScan(window=128, drop=0.5, source=AnswerCheck(0, 0, 6, 3.0, 512), far={1: 0})
    assert nothing.retrieval_layers == []  # a source that answers nothing has no retrieval layer


def test_scan_arguments_are_checked():
    from tests.tiny_models import tiny_tokenizer

    tok = tiny_tokenizer()
    filler = torch.tensor(tok("Filler about rivers and bread. " * 30, add_special_tokens=False)["input_ids"][:400])
    probes = make_probes(tok, filler.view(2, 200), per_depth=1)
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"drop=0; allowed: a share in \(0, 1\]"):
        scan_retrieval_layers(model, probes, 16, drop=0)
    with pytest.raises(ValueError, match="window=190 reaches the far facts of 200-token probes; allowed: < 170"):
        scan_retrieval_layers(model, probes, 190)
    with pytest.raises(ValueError, match="no far probes"):
        scan_retrieval_layers(model, [p for p in probes if p.depth == "near"], 16)


def test_the_scan_finds_smollm2s_far_reading_layer(smollm2):
    from hf_csa2.data.corpus import resolve_text
    from hf_csa2.data.windows import token_windows

    windows = token_windows(smollm2.tokenizer, resolve_text("python-docs:heldout"), 512, 3)
    probes = make_probes(smollm2.tokenizer, windows, per_depth=4)
    scan = scan_retrieval_layers(smollm2.model, probes, window=128, layers=[16, 18])
    assert scan.source.far >= 3
    assert scan.far[16] >= scan.source.far - 1 and scan.far[18] <= 1  # by hand: 10/10 and 0/10 of 10
    assert scan.retrieval_layers == [18]


def test_the_sufficient_set_gives_back_the_far_reading_layer_first(smollm2):
    from hf_csa2.data.corpus import resolve_text
    from hf_csa2.data.windows import token_windows
    from hf_csa2.metrics.retrieval_layers import sufficient_far_layers

    windows = token_windows(smollm2.tokenizer, resolve_text("python-docs:heldout"), 512, 3)
    probes = make_probes(smollm2.tokenizer, windows, per_depth=4)
    found = sufficient_far_layers(smollm2.model, probes, 128, layers=[16, 17, 18], sink_tokens=4, keep=0.75)
    assert found.steps[0][0] == [] and found.steps[0][1] < found.target  # 16-18 cut: the answers are gone
    assert found.steps[1][0] == [18] and found.layers == [18]  # 18 alone brings them back
    assert "| 18 |" in found.table()
    with pytest.raises(ValueError, match=r"keep=0; allowed: a share in \(0, 1\]"):
        sufficient_far_layers(smollm2.model, probes, 128, keep=0)


def test_cli_eval_retrieval_layers(tmp_path, capsys):
    import json

    from hf_csa2.cli import main
    from tests.tiny_models import save_tiny_source

    save_tiny_source("llama", tmp_path / "src", num_layers=2)
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    out = tmp_path / "scan.json"
    args = ["eval", "retrieval-layers", str(tmp_path / "src"), "--text", str(text), "--context", "256", "--window",
            "32", "--per-depth", "2", "--windows", "2"]
    assert main(args + ["--sufficient", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert sorted(doc["scan"]["far"]) == ["0", "1"] and doc["scan"]["source"]["per_depth"] == 2
    assert doc["sufficient"]["steps"][0][0] == [] and doc["scan"]["sink_tokens"] == 4
    assert "| layer cut to its last 32 tokens (+4 first) |" in capsys.readouterr().out
    for flag, value, message in (("--window", "240", "--window 240 reaches the far facts of 256-token probes"),
                                 ("--drop", "1.5", "--drop 1.5; allowed: a share in (0, 1]"),
                                 ("--sink-tokens", "-1", "--sink-tokens -1; allowed: an integer >= 0")):
        assert main(args + [flag, value]) == 2
        assert message in capsys.readouterr().err
