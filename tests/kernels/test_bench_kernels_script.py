"""scripts/bench_kernels.py (the GPU benchmark the issue asks a lent GPU to run) runs end to end:
tiny sizes in Triton's CPU interpreter, every case timed, the JSON table written."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_kernels.py"


def test_the_smoke_run_times_every_case_and_writes_the_table(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    run = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--json", str(out)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    table = json.loads(out.read_text())["80"]
    kinds = ("sparse read fwd: ", "sparse read fwd+bwd: ", "indexer select: ", "decode GQA 9/3 x 64, batch 8: ",
             "decode MLA absorbed 9 x 97/65, batch 1: ")
    for kind in kinds:
        assert any(name.startswith(kind) and "kernel" in name for name in table), kind
    assert all(isinstance(v, float) and v > 0 for v in table.values()), table
