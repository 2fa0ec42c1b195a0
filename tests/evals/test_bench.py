"""Cost benchmark on tiny models: fields, interleaving, KV bytes equal to the config figure."""

import json

import pytest
from tiny_models import save_tiny_source, tiny_model

from hf_csa2.cli import main as cli_main
from hf_csa2.evals.bench import bench, format_bench_table
from hf_csa2.metrics.decode_bound import decode_read_bytes
from hf_csa2.metrics.kv_cache import config_kv_elements_per_token
from hf_csa2.surgery.gqa import apply_gqa
from hf_csa2.surgery.plan import GqaPlan


def test_bench_rows_and_kv_bytes_match_config():
    src = tiny_model("llama")
    mqa = apply_gqa(src, GqaPlan(num_key_value_heads=1, init="mean"))[0]
    rows = bench([("src", src), ("mqa", mqa)], [24, 40], new_tokens=3, repeats=2, batch=2)
    assert [(r["length"], r["model"]) for r in rows] == [(24, "src"), (24, "mqa"), (40, "src"), (40, "mqa")]
    for r, model in zip(rows, [src, mqa, src, mqa]):
        assert len(r["runs"]) == 2 and r["prefill_s"] > 0 and r["decode_ms_per_token"] > 0
        per_token = config_kv_elements_per_token(model.config)
        assert r["kv_elements"] == per_token * r["cached_tokens"] * 2  # batch 2
        assert r["kv_bytes"] == r["kv_elements"] * 4  # fp32
    assert rows[1]["kv_bytes_ratio"] == pytest.approx(0.5)  # 2 KV heads -> 1
    for ref, other in ((rows[0], rows[1]), (rows[2], rows[3])):  # each length against its own reference row
        for key in ("prefill_s", "decode_ms_per_token", "kv_bytes"):
            assert other[f"{key}_ratio"] == pytest.approx(other[key] / ref[key], rel=1e-12)
    assert rows[3]["kv_bytes_ratio"] == pytest.approx(0.5)
    for r, model in zip(rows, [src, mqa, src, mqa]):  # the read bound at the middle decode step, batch 2
        assert r["decode_read_bytes"] == decode_read_bytes(model, r["length"] + 2, batch=2)
        assert r["decode_bound_fraction"] == pytest.approx(r["decode_bound_ms"] / r["decode_ms_per_token"])
    assert rows[1]["decode_read_bytes"] < rows[0]["decode_read_bytes"]  # MQA reads half the cache
    assert "| 24 | mqa |" in format_bench_table(rows)


def test_bench_refuses_mixed_dtypes():
    import torch

    with pytest.raises(ValueError, match="dtypes"):
        bench([("a", tiny_model("llama")), ("b", tiny_model("llama").to(torch.bfloat16))], [8], repeats=1)


def test_bench_cli(tmp_path):
    save_tiny_source("qwen3", tmp_path / "m")
    code = cli_main(["bench", str(tmp_path / "m"), str(tmp_path / "m"), "--lengths", "16", "--new-tokens", "2",
                     "--repeats", "1", "--json", str(tmp_path / "b.json")])
    assert code == 0
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert len(rows) == 2 and rows[1]["kv_bytes_ratio"] == 1.0
