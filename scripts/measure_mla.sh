#!/usr/bin/env bash
# Reproduces the MLA numbers quoted in README.md and conversion/smollm2-mla-*.yaml,
# conversion/gemma3-mla-quarter.yaml: converts with each preset (the stage reports hold the
# weight-SVD comparison), exports the DeepSeek-V3 variant and checks it against hf-csa2, then
# scores every model on the SAME held-out windows in one process (ratios to the original).
# Needle capabilities at 2K for the 1/4 preset vs the original: pass --needle.
set -euo pipefail
OUT=${OUT:-runs}
mkdir -p "$OUT"
for preset in smollm2-mla-half smollm2-mla-quarter smollm2-mla-quarter-dsv3; do
  hf-csa2 convert smollm2-135m --plan "conversion/$preset.yaml" --out "$OUT/$preset" --overwrite
done
hf-csa2 export "$OUT/smollm2-mla-quarter-dsv3" --format deepseek_v3 --out "$OUT/smollm2-mla-quarter-dsv3-export" --overwrite
python scripts/check_export.py "$OUT/smollm2-mla-quarter-dsv3" "$OUT/smollm2-mla-quarter-dsv3-export"
python scripts/check_export.py "$OUT/smollm2-mla-quarter-dsv3" "$OUT/smollm2-mla-quarter-dsv3-export" --dtype float64
hf-csa2 eval ppl smollm2-135m "$OUT/smollm2-mla-half" "$OUT/smollm2-mla-quarter" "$OUT/smollm2-mla-quarter-dsv3" \
  "$OUT/smollm2-mla-quarter-dsv3-export" --text python-docs:heldout --window 512 --max-windows 16 --json "$OUT/mla_heldout_ppl.json"
for preset in smollm2-mla-half smollm2-mla-quarter smollm2-mla-quarter-dsv3; do
  hf-csa2 inspect "$OUT/$preset" | tail -1
done
hf-csa2 convert gemma3-270m --plan conversion/gemma3-mla-quarter.yaml --out "$OUT/gemma3-mla-quarter" --overwrite
hf-csa2 eval ppl gemma3-270m "$OUT/gemma3-mla-quarter" --text python-docs:heldout --window 512 --max-windows 16 \
  --json "$OUT/gemma3_mla_heldout_ppl.json"
if [[ "${1:-}" == "--needle" ]]; then
  hf-csa2 eval needle smollm2-135m "$OUT/smollm2-mla-quarter" --out "$OUT/needle-mla-quarter" --lengths 2048 --per-cell 4
fi
