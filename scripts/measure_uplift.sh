#!/usr/bin/env bash
# One uplifted checkpoint against its source and its one-shot conversion, each table from one run:
# held-out ppl (16 x 512) on both corpora, the answer check at 512 and 1,024 tokens (20 facts per depth)
# on both corpora, and the needle suite at 1K and 2K (six capabilities, depths 0 / 0.5 / 1, 7 per cell =
# 21 per capability and length; source and uplifted only).
#
#   bash scripts/dev.sh bash scripts/measure_uplift.sh SOURCE ONE_SHOT_DIR UPLIFTED_DIR OUT_DIR
#
# e.g. SOURCE=smollm2-135m ONE_SHOT_DIR=runs/smollm2-mqa UPLIFTED_DIR=runs/train/smollm2-mqa/merged.
# Writes OUT_DIR/{ppl-*.json, answers-*.json, needle/} and prints every table.
set -euo pipefail
if [ $# -ne 4 ]; then
    echo "usage: $0 SOURCE ONE_SHOT_DIR UPLIFTED_DIR OUT_DIR" >&2
    exit 2
fi
src=$1 oneshot=$2 uplifted=$3 out=$4
mkdir -p "$out"
for text in python-docs:heldout fortunes:heldout; do
    name=${text%%:*}
    echo "## ppl $text 16 x 512"
    hf-csa2 eval ppl "$src" "$oneshot" "$uplifted" --text "$text" --window 512 --max-windows 16 --json "$out/ppl-$name.json"
    for ctx in 512 1024; do
        echo "## answers $text $ctx"
        hf-csa2 eval answers "$src" "$oneshot" "$uplifted" --text "$text" --context "$ctx" --per-depth 20 \
            --json "$out/answers-$name-$ctx.json"
    done
done
echo "## needle 1K, 2K"
hf-csa2 eval needle "$src" "$uplifted" --out "$out/needle" --lengths 1024,2048 --depths 0,0.5,1 --per-cell 7
