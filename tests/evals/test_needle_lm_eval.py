"""The needle task under the stock lm-eval CLI gives the same outputs and accuracy as
`hf-csa2 eval needle` on the same samples, in both prompt styles."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import save_tiny_source, tiny_tokenizer

from hf_csa2.cli import main as cli_main
from hf_csa2.evals.needle import generate_samples, write_jsonl
from hf_csa2.evals.needle_eval import generate_answers, score_records

from .test_needle import haystack

pytest.importorskip("lm_eval", reason="lm-eval is in the eval extra")
REPO = Path(__file__).resolve().parents[2]
LM_EVAL = shutil.which("lm-eval") or str(Path(sys.executable).parent / "lm-eval")


def test_lm_eval_validate_passes_on_every_task_yaml():
    yamls = sorted((REPO / "evals").rglob("*.yaml"))
    assert yamls
    tasks = [__import__("yaml").safe_load(p.read_text().replace("!function", "")).get("task") for p in yamls]
    proc = subprocess.run([LM_EVAL, "validate", "--tasks", ",".join(tasks), "--include_path", str(REPO / "evals")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "valid" in proc.stdout + proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_stock_lm_eval_matches_hf_csa2_eval_needle(tmp_path):
    model = save_tiny_source("llama", tmp_path / "model", max_position_embeddings=4096)  # no truncation in HFLM
    tok = tiny_tokenizer()
    # both prompt styles in one task file: chat-style at depth 0, completion-style (base models) at depth 1
    samples = (generate_samples(tok, haystack(), lengths=(1500,), depths=(0.0,), per_cell=1, seed=5)
               + generate_samples(tok, haystack(), lengths=(1500,), depths=(1.0,), per_cell=1, seed=5, style="completion"))
    write_jsonl(samples, tmp_path / "samples.jsonl")
    ours = score_records(samples, generate_answers(model, tok, samples, max_new_tokens=32))

    proc = subprocess.run(
        [LM_EVAL, "run", "--model", "hf", "--model_args", f"pretrained={tmp_path / 'model'},dtype=float32",
         "--include_path", str(REPO / "evals"), "--tasks", "hf_csa2_needle", "--batch_size", "1",
         "--metadata", json.dumps({"needle_jsonl": str(tmp_path / "samples.jsonl")}),
         "--output_path", str(tmp_path / "lm_eval"), "--log_samples"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = [json.loads(line) for p in (tmp_path / "lm_eval").rglob("samples_hf_csa2_needle_*.jsonl")
              for line in p.read_text().splitlines()]
    theirs = {row["doc"]["id"]: row for row in logged}
    assert len(theirs) == len(samples)
    for rec in ours:
        row = theirs[rec["id"]]
        assert row["filtered_resps"][0] == rec["output"], (rec["id"], row["filtered_resps"][0], rec["output"])
        assert row["acc"] == float(rec["correct"])
    results = json.loads(next((tmp_path / "lm_eval").rglob("results_*.json")).read_text())["results"]["hf_csa2_needle"]
    assert results["acc,none"] == pytest.approx(sum(r["correct"] for r in ours) / len(ours))

    # and in-process through `hf-csa2 eval lm` (HFLM over the model hf-csa2 loads)
    code = cli_main(["eval", "lm", str(tmp_path / "model"), "--tasks", "hf_csa2_needle", "--metadata",
                     json.dumps({"needle_jsonl": str(tmp_path / "samples.jsonl")}), "--json", str(tmp_path / "ours.json")])
    assert code == 0
    in_process = json.loads((tmp_path / "ours.json").read_text())["results"]["hf_csa2_needle"]
    for key, value in results.items():
        if key.startswith("acc") and "stderr" not in key:
            assert in_process[key] == pytest.approx(value, nan_ok=True), key
