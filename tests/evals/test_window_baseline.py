"""The window baseline ``window:W+P:SOURCE``: the source's logits under an explicit window + first-tokens
mask (a layer with a shorter sliding window keeps it), the same when decoding with its cache, its live
cache holding W - 1 + P tokens per layer, usable wherever a command takes a model, and bad names refused."""

import json

import pytest
import torch
from tiny_models import save_tiny_source, tiny_model

from hf_csa2.cli import main as cli_main
from hf_csa2.errors import InputError
from hf_csa2.evals.window_baseline import WindowModel, layer_windows, parse_window_model, window_model

W, P = 6, 2


def band(t: int, window: int, first: int) -> torch.Tensor:
    """Additive mask [1, 1, T, T]: causal, the last ``window`` tokens and the first ``first``."""
    i = torch.arange(t)
    allow = (i[None, :] <= i[:, None]) & ((i[:, None] - i[None, :] < window) | (i[None, :] < first))
    return torch.zeros(t, t).masked_fill(~allow, float("-inf"))[None, None]


@pytest.mark.parametrize("arch, window, windows", [
    ("llama", W, [6, 6]),
    ("mistral", W, [6, 6]),  # its own sliding window is 7
    ("mistral", 10, [7, 7]),
    ("gemma3_text", 10, [7, 10]),  # sliding layer keeps its 7, the global layer reads 10
])
def test_the_baseline_is_the_source_under_a_window_mask(arch, window, windows):
    source = tiny_model(arch).eval()
    ids = torch.randint(4, 100, (1, 20))
    baseline = window_model(source, window, P).eval()
    assert layer_windows(source.config, window) == windows
    source.config._attn_implementation = "eager"
    with torch.no_grad():
        if arch == "gemma3_text":
            masks = {"sliding_attention": band(20, windows[0], P), "full_attention": band(20, windows[1], P)}
            expected = source(ids, attention_mask=masks).logits
        else:
            expected = source(ids, attention_mask=band(20, windows[0], P)).logits
        got = baseline(ids).logits
        plain = source(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert (got - plain).abs().max() > 1e-3  # the window matters at 20 tokens
    # decoding with the cache reads the same tokens
    with torch.no_grad():
        out = baseline(ids[:, :12], use_cache=True)
        cache, steps = out.past_key_values, []
        for j in range(12, 20):
            step = baseline(ids[:, j : j + 1], past_key_values=cache, use_cache=True)
            cache = step.past_key_values
            steps.append(step.logits[:, -1])
    torch.testing.assert_close(torch.stack(steps, 1), got[:, 12:], atol=1e-4, rtol=1e-4)


def test_a_shorter_own_sliding_window_is_kept():
    source = tiny_model("gemma3_text", num_layers=3)
    assert layer_windows(source.config, 16) == [7, 16, 7]  # sliding layers keep their 7, the global one gets 16


def test_names_are_parsed_and_bad_ones_refused():
    assert parse_window_model("smollm2-135m") is None
    assert parse_window_model("window:512+4:gemma3-270m") == WindowModel(512, 4, "gemma3-270m")
    assert parse_window_model("window:8+0:/tmp/a:b") == WindowModel(8, 0, "/tmp/a:b")
    for bad in ("window:512:gemma3-270m", "window:1+0:x", "window:a+4:x", "window:512+4:"):
        with pytest.raises(InputError, match=r"window:W\+P:SOURCE"):
            parse_window_model(bad)


def test_commands_take_a_window_baseline_and_count_its_cache(tmp_path, capsys):
    save_tiny_source("llama", tmp_path / "src")
    name = f"window:{W}+{P}:{tmp_path / 'src'}"
    capsys.readouterr()
    assert cli_main(["inspect", name, "--context", "40", "--json"]) == 0
    base = json.loads(capsys.readouterr().out)
    assert cli_main(["inspect", str(tmp_path / "src"), "--context", "40", "--json"]) == 0
    full = json.loads(capsys.readouterr().out)
    measured = base["kv_elements_per_token_at_context_measured"]
    assert measured == base["kv_elements_per_token_at_context_config"]
    assert measured == pytest.approx(full["kv_elements_per_token_at_context_measured"] * (W - 1 + P) / 40)
    (tmp_path / "text.txt").write_text(" ".join(f"word{i % 17} and more {i}" for i in range(400)))
    out = tmp_path / "ppl.json"
    assert cli_main(["eval", "ppl", str(tmp_path / "src"), name, "--text", str(tmp_path / "text.txt"),
                     "--window", "32", "--max-windows", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert rows[1]["model"] == name and rows[1]["ppl"] != rows[0]["ppl"]
    capsys.readouterr()
    assert cli_main(["eval", "ppl", "window:4:x", "--text", str(tmp_path / "text.txt")]) == 2
    assert "window:W+P:SOURCE" in capsys.readouterr().err
