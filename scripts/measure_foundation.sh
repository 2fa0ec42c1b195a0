#!/usr/bin/env bash
# Reproduces the numbers quoted in README.md and conversion/smollm2-{mqa,sinks}.yaml:
# converts SmolLM2-135M with each preset, then scores every model on the SAME held-out
# windows in one process (ratios to the original).
set -euo pipefail
OUT=${1:-runs}
mkdir -p "$OUT"
for preset in smollm2-mqa smollm2-mqa-mean smollm2-sinks; do
  hf-csa2 convert smollm2-135m --plan "conversion/$preset.yaml" --out "$OUT/$preset" --overwrite
done
hf-csa2 eval ppl smollm2-135m "$OUT/smollm2-mqa" "$OUT/smollm2-mqa-mean" "$OUT/smollm2-sinks" \
  --text python-docs:heldout --window 512 --max-windows 16 --json "$OUT/heldout_ppl.json"
