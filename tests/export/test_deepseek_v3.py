"""Export of MLA checkpoints to stock DeepseekV3ForCausalLM (no remote code)."""

import subprocess
import sys

import pytest
import torch
from tiny_models import VOCAB, save_tiny_source, tiny_model, tiny_tokenizer
from transformers import AutoModelForCausalLM

from hf_csa2.export.deepseek_v3 import ExportError, export_problems, to_deepseek_v3
from hf_csa2.surgery.mla import apply_mla
from hf_csa2.surgery.plan import MlaPlan
from hf_csa2.surgery.sinks import add_sinks

# The DeepSeek-V3 layout: a shared rope key (3 slots), a normalised latent, one rope table.
EXPORTABLE = MlaPlan(kv_lora_rank=6, qk_rope_head_dim=6, rope_key="shared", latent_norm=True, uniform_rope=True)

def windows():
    return torch.randint(3, VOCAB, (4, 32), generator=torch.Generator().manual_seed(1))


def ids(batch=2, length=13):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(5))


def exportable(kv_heads=2):
    src = tiny_model("llama", num_kv_heads=kv_heads)
    return apply_mla(src, EXPORTABLE, windows=windows())[0]


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_exported_model_matches_and_reloads_without_remote_code(kv_heads, tmp_path):
    model = exportable(kv_heads)
    assert export_problems(model) == []
    stock = to_deepseek_v3(model)
    x = ids()
    assert (stock(x).logits - model(x).logits).abs().max() <= 1e-4
    stock.save_pretrained(tmp_path / "ds")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ds").eval()
    assert type(reloaded).__name__ == "DeepseekV3ForCausalLM"
    assert (reloaded(x).logits - model(x).logits).abs().max() <= 1e-4
    prompt = x[:1, :5]
    assert torch.equal(reloaded.generate(prompt, max_new_tokens=6, do_sample=False),
                       model.generate(prompt, max_new_tokens=6, do_sample=False))


def test_non_exportable_models_are_refused_with_every_reason():
    src = tiny_model("llama")
    per_head, _ = apply_mla(src, MlaPlan(kv_lora_rank=6, qk_rope_head_dim=4, rope_key="per_head"), windows=windows())
    problems = export_problems(add_sinks(per_head))
    assert any("per-head rope keys" in p for p in problems)
    assert any("unnormalised latent" in p for p in problems)
    assert any("sink logits" in p for p in problems)
    with pytest.raises(ExportError, match="per-head rope keys"):
        to_deepseek_v3(per_head)
    qwen3, _ = apply_mla(tiny_model("qwen3"), MlaPlan(kv_lora_rank=6, qk_rope_head_dim=4, rope_key="per_head"), windows=windows())
    assert any("'qwen3'" in p for p in export_problems(qwen3))
    qwen2, _ = apply_mla(tiny_model("qwen2"), EXPORTABLE, windows=windows())
    assert export_problems(qwen2) == ["query or up-projection biases (allowed: a latent bias only)"]
    assert "not an hf_csa2 model" in export_problems(src)[0]


@pytest.mark.slow
def test_cli_export_and_refusal(tmp_path):
    model = exportable()
    model.save_pretrained(tmp_path / "mla")
    tiny_tokenizer().save_pretrained(tmp_path / "mla")
    run = [sys.executable, "-m", "hf_csa2.cli", "export", str(tmp_path / "mla"), "--format", "deepseek_v3"]
    ok = subprocess.run([*run, "--out", str(tmp_path / "ds")], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert (tmp_path / "ds" / "config.json").exists()
    again = subprocess.run([*run, "--out", str(tmp_path / "ds")], capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "--overwrite" in again.stderr
    save_tiny_source("llama", tmp_path / "dense")
    bad = subprocess.run([sys.executable, "-m", "hf_csa2.cli", "export", str(tmp_path / "dense"), "--out", str(tmp_path / "x")],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "not an hf_csa2 model" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "x").exists()
    fmt = subprocess.run([*run, "--format", "gguf", "--out", str(tmp_path / "y")], capture_output=True, text=True, timeout=300)
    assert fmt.returncode == 2 and "allowed: deepseek_v3" in fmt.stderr
