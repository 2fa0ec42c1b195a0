"""eval compare: zero for an unconverted copy, points at a perturbed layer, splits near/far and by bucket."""

import copy
import json
import math

import pytest
import torch

from hf_csa2.cli import main
from hf_csa2.evals.compare import compare_models, format_compare_tables
from tests.tiny_models import ARCHS, VOCAB, save_tiny_source, tiny_model


def windows(n=2, t=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, VOCAB, (n, t), generator=g)


@pytest.mark.parametrize("arch", ARCHS)
def test_an_unconverted_copy_agrees_everywhere(arch):
    source = tiny_model(arch, num_layers=3)
    report = compare_models(source, copy.deepcopy(source), windows(), bucket=8)
    assert [(b.start, b.end) for b in report.buckets] == [(0, 8), (8, 16), (16, 24)]
    for b in report.buckets:
        assert b.top1_agreement == 1.0
        assert abs(b.kl) < 1e-12
        assert b.nll_source == pytest.approx(b.nll_converted, abs=1e-12)
        assert b.nll_source > 0
    assert all(s.near_rel_err == 0.0 and s.far_rel_err in (0.0, None) for s in report.layers)
    assert "| 0-8 | 1.000 |" in format_compare_tables(report)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_a_perturbed_layer_is_the_one_pointed_at(arch):
    source = tiny_model(arch, num_layers=4)
    converted = copy.deepcopy(source)
    with torch.no_grad():  # noise, not a scale: Gemma-3 normalises the attention output after o_proj
        w = converted.model.layers[2].self_attn.o_proj.weight
        w.add_(0.5 * w.std() * torch.randn(w.shape, generator=torch.Generator().manual_seed(0)))
    report = compare_models(source, converted, windows(), bucket=8)
    assert report.worst_layer == 2
    errors = [s.near_rel_err for s in report.layers]
    # Each layer is fed the source's input, so the layers after 2 make no error of their own.
    assert errors[2] > 0.05
    assert errors[0] == errors[1] == errors[3] == 0.0
    assert report.top1_agreement < 1.0 or max(b.kl for b in report.buckets) > 1e-6


def test_far_error_is_separated_from_near_error():
    """A change that only matters for keys older than the split shows in the far column only."""
    source = tiny_model("llama", num_layers=2)
    converted = copy.deepcopy(source)
    window = 6
    original = converted.model.layers[1].self_attn.forward

    def windowed(*args, **kwargs):
        # Same layer, but a query may only read its last `window` positions (a sliding window).
        mask = kwargs["attention_mask"]
        t = kwargs["hidden_states"].shape[1] if "hidden_states" in kwargs else args[0].shape[1]
        pos = torch.arange(t)
        allowed = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < window)
        kwargs["attention_mask"] = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]
        del mask
        return original(*args, **kwargs)

    converted.model.layers[1].self_attn.forward = windowed
    report = compare_models(source, converted, windows(t=20), bucket=10, near=window)
    layer = report.layers[1]
    assert layer.window == window and layer.near_positions == 2 * window
    assert layer.near_rel_err < 1e-6  # inside the window nothing changed
    assert layer.far_rel_err > 1e-3
    assert report.layers[0].near_rel_err == report.layers[0].far_rel_err == 0.0
    assert report.buckets[0].kl < report.buckets[1].kl


def test_models_that_are_not_a_source_and_its_conversion_are_refused():
    with pytest.raises(ValueError, match="decoder layers"):
        compare_models(tiny_model("llama", num_layers=2), tiny_model("llama", num_layers=3), windows())
    with pytest.raises(ValueError, match="windows must be"):
        compare_models(tiny_model("llama"), tiny_model("llama"), torch.zeros(5, dtype=torch.long))


def test_cli_eval_compare_writes_json(tmp_path, capsys):
    save_tiny_source("qwen3", tmp_path / "src", num_layers=2)
    save_tiny_source("qwen3", tmp_path / "other", num_layers=2, seed=1)
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "compare.json"
    rc = main(["eval", "compare", str(tmp_path / "src"), str(tmp_path / "other"), "--text", str(text),
               "--context", "64", "--max-windows", "2", "--bucket", "32", "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["context"] == 64 and doc["windows"] == 2 and len(doc["buckets"]) == 2
    assert len(doc["layers"]) == 2
    # different random weights: the models disagree somewhere and every layer differs
    assert 0.0 <= doc["top1_agreement"] < 1.0
    assert all(layer["near_rel_err"] > 0 for layer in doc["layers"])
    assert all(math.isfinite(b["kl"]) and b["kl"] > 0 for b in doc["buckets"])
    assert "top-1 agreement" in capsys.readouterr().out
