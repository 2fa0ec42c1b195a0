#!/usr/bin/env bash
# Convert SmolLM2 with conversion/smollm2-mqa-sinks.yaml, then load the result in a FRESH venv
# that has torch + transformers but not hf_csa2 (trust_remote_code=True), and compare its logits
# and greedy generation with the in-memory converted model of this environment.
set -euo pipefail
OUT=${1:-runs}
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
hf-csa2 convert smollm2-135m --plan conversion/smollm2-mqa-sinks.yaml --out "$OUT/smollm2-mqa-sinks" --overwrite
python - "$OUT" <<'PY'
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
import hf_csa2  # noqa: F401
out = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(f"{out}/smollm2-mqa-sinks").eval()
tok = AutoTokenizer.from_pretrained(f"{out}/smollm2-mqa-sinks")
ids = tok("The Python tutorial explains how a for statement iterates over a sequence.", return_tensors="pt")
gen = model.generate(**ids, max_new_tokens=20, do_sample=False)
torch.save({"ids": ids.input_ids, "logits": model(**ids).logits, "text": tok.decode(gen[0])}, f"{out}/round_trip_expected.pt")
PY
FRESH="$OUT/fresh-venv"
if [[ ! -x "$FRESH/bin/python" ]]; then
  python3 -m venv "$FRESH"
  "$FRESH/bin/pip" install -q "torch==2.13.0" "transformers==5.24.0" safetensors
fi
# Run from an unrelated folder: from the repo root, ./hf_csa2 itself would be importable.
cd "$(mktemp -d)"
"$FRESH/bin/python" - "$OUT" <<'PY'
import sys, torch
try:
    import hf_csa2  # noqa: F401
    sys.exit("hf_csa2 is importable in the fresh venv: the check would prove nothing")
except ImportError:
    pass
from transformers import AutoModelForCausalLM, AutoTokenizer
out = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(f"{out}/smollm2-mqa-sinks", trust_remote_code=True).eval()
tok = AutoTokenizer.from_pretrained(f"{out}/smollm2-mqa-sinks", trust_remote_code=True)
want = torch.load(f"{out}/round_trip_expected.pt")
logits = model(input_ids=want["ids"]).logits
gen = model.generate(input_ids=want["ids"], attention_mask=torch.ones_like(want["ids"]), max_new_tokens=20, do_sample=False)
text = tok.decode(gen[0])
print(f"class {type(model).__module__}.{type(model).__name__}")
print(f"max abs logit diff vs hf_csa2-native load: {(logits - want['logits']).abs().max().item():.3g}")
print(f"greedy text identical: {text == want['text']}")
print(repr(text))
PY
