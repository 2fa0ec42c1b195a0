"""Write tests/fixtures/checkpoints-0.1/: tiny hf_csa2 checkpoints saved by THIS version of the
model code, with the logits they must keep giving. Later versions (renamed classes, new cache
layers, new config fields) are tested against them: checkpoints users already saved must load.

    bash scripts/dev.sh python scripts/make_checkpoint_fixtures.py

Run it once per format change worth freezing, into a new folder name; never regenerate an old one.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "model"))

from test_csa2_attention import MIXED_PLAN, csa2_model  # noqa: E402
from tiny_models import VOCAB, tiny_model, tiny_tokenizer  # noqa: E402

from hf_csa2.io.checkpoint import save_checkpoint  # noqa: E402
from hf_csa2.surgery.gqa import apply_gqa  # noqa: E402
from hf_csa2.surgery.plan import GqaPlan  # noqa: E402
from hf_csa2.surgery.mla import apply_mla  # noqa: E402
from hf_csa2.surgery.plan import MlaPlan  # noqa: E402
from hf_csa2.surgery.sinks import add_sinks  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "checkpoints-0.1"
IDS = torch.randint(3, VOCAB, (2, 21), generator=torch.Generator().manual_seed(7))


def active_sinks(model):
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g))
    return model


def models():
    src = tiny_model("llama")
    yield "dense-gqa-sinks", active_sinks(add_sinks(apply_gqa(src, GqaPlan(num_key_value_heads=1, init="mean"))[0]))
    gemma = tiny_model("gemma3_text")
    calib = torch.randint(3, VOCAB, (4, 32), generator=torch.Generator().manual_seed(1))
    yield "mla-gemma3", apply_mla(gemma, MlaPlan(kv_lora_rank=8, qk_rope_head_dim=4, rope_key="per_head"), windows=calib)[0]
    yield "csa2-mixed", csa2_model("llama", *MIXED_PLAN, sink_tokens=2)[0]


def main() -> None:
    if OUT.exists():
        raise SystemExit(f"{OUT} exists: fixtures are frozen; write a new version folder instead")
    for name, model in models():
        model.eval()
        folder = OUT / name
        save_checkpoint(model, tiny_tokenizer(), folder)
        for code in folder.glob("*.py"):  # the copied model code is for machines without hf_csa2
            code.unlink()
        with torch.no_grad():
            logits = model(IDS).logits
        save_file({"input_ids": IDS, "logits": logits.contiguous()}, folder / "expected.safetensors")
        print(f"wrote {folder}")
    shutil.rmtree(OUT / "__pycache__", ignore_errors=True)


if __name__ == "__main__":
    main()
