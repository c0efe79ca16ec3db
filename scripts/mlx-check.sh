#!/usr/bin/env bash
# Proof that mlx-lm (an independent implementation) loads what `ferrolm convert` writes, on
# the real SmolLM2 model, CPU only. Needs: pip install "mlx[cpu]" mlx-lm (installed here if
# missing). Checks, each failing the script on error:
#  1. GGUF → MLX (weights kept exactly): mlx-lm's next-token argmax over the golden "prose"
#     text (its first 128 positions) agrees with Hugging Face Transformers'
#     (goldens/smollm2_hf.json) on ≥ 95% of positions;
#  2. mlx_lm.load with our tokenizer files tokenizes a prompt exactly as ferrolm does;
#  3. GGUF → bf16 (a plain Hugging Face style safetensors dir) → 8-bit MLX, and GGUF → 4-bit:
#     mlx-lm's argmax agrees with ferrolm running the same directory on ≥ 95% of positions;
#  4. the same for a synthetic llama-3.2-1b (`convert --synthetic`: random weights, Llama 3
#     RoPE scaling, tied head, SmolLM2's tokenizer padded to 128256 ids).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import mlx_lm" 2>/dev/null || python3 -m pip install --quiet "mlx[cpu]" mlx-lm
# FERROLM: a ferrolm binary already built (scripts/test.sh passes its own, whose engine has
# the test features: building the CLI alone here would compile the engine a second time).
[[ -n ${FERROLM:-} ]] || cargo build --release -q -p ferrolm-cli
bin=${FERROLM:-${CARGO_TARGET_DIR:-target}/release/ferrolm}
model=$(python3 - <<'PY'
import os
home = os.environ.get("FERROLM_HOME", os.path.expanduser("~/.cache/ferrolm"))
print(os.path.join(home, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
PY
)
[[ -f $model ]] || $bin inspect >/dev/null   # fetches the default model
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
golden=crates/engine/tests/goldens/smollm2_hf.json
python3 - "$golden" "$tmp" <<'PY'
import json, sys
g = json.load(open(sys.argv[1]))
t = next(t for t in g["texts"] if t["name"] == "prose")
# argmax[i] predicts ids[i+1]: the last token has no target, so it is not fed.
json.dump({"tokens": t["ids"][:-1], "argmax": t["argmax"]}, open(sys.argv[2] + "/hf.json", "w"))
# mlx-lm runs the first 128 positions (causal, so they equal a 128-token run): its CPU
# matmuls run ~0.14 s a position on one core, and 128 leave a weight mismatch no hiding
# place (one of 273 positions differs in the quantized cases).
json.dump({"tokens": t["ids"][:128], "argmax": t["argmax"][:128]}, open(sys.argv[2] + "/hf128.json", "w"))
open(sys.argv[2] + "/prose.txt", "w").write(t["text"])
PY

echo "== 1. GGUF -> MLX, mlx-lm vs Transformers"
$bin convert --input "$model" --output "$tmp/native"
python3 tools/oracle/mlx_load_check.py "$tmp/native" --expect "$tmp/hf128.json"

echo "== 2. tokenizer files load in mlx-lm and agree with ferrolm"
prompt="Hello world! The year 2024 had 366 days; ünïcödé, 中文 and emoji 🎉."
python3 tools/oracle/mlx_load_check.py "$tmp/native" --prompt "$prompt" --write-expect "$tmp/mlx_tok.json"
ours=$($bin tokenize --model "$tmp/native" --text "$prompt" --special)
gguf=$($bin tokenize --model "$model" --text "$prompt" --special)
python3 - "$tmp/mlx_tok.json" "$ours" "$gguf" <<'PY'
import json, sys
mlx = json.load(open(sys.argv[1]))["tokens"]
ours, gguf = json.loads(sys.argv[2]), json.loads(sys.argv[3])
assert mlx == ours == gguf, f"token ids differ:\nmlx  {mlx}\nours {ours}\ngguf {gguf}"
print(f"tokenizer OK: {len(mlx)} ids identical (mlx-lm, ferrolm on the MLX dir, ferrolm on the GGUF)")
PY

check_case() {
  local case=$1
  echo "== 3/4. $case: mlx-lm vs ferrolm on the same directory"
  local out="$tmp/$case-$RANDOM" own="$tmp/$case"
  mkdir -p "$own"
  if [[ $case == synthetic ]]; then
    $bin convert --synthetic llama-3.2-1b --output "$out"
  elif [[ $case == bf16:* ]]; then
    $bin convert --input "$model" --output "$own/bf16" --quantize bf16
    $bin convert --input "$own/bf16" --output "$out" --quantize "${case#bf16:}"
  else
    $bin convert --input "$model" --output "$out" --quantize "$case"
  fi
  $bin perplexity --model "$out" --file "$tmp/prose.txt" --ctx 512 --json > "$own/ppl.json"
  python3 - "$own/ppl.json" "$tmp/hf.json" "$own/ours.json" "$case" "$tmp/hf128.json" <<'PY'
import json, sys
p, hf = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
assert p["targets"][:-1] == hf["tokens"][1:], "ferrolm tokenized the prose differently"
# mlx-lm runs hf128.json's positions, the 1B synthetic model's first 64.
n = 64 if sys.argv[4] == "synthetic" else len(json.load(open(sys.argv[5]))["tokens"])
json.dump({"tokens": hf["tokens"][:n], "argmax": p["argmax"][:n]}, open(sys.argv[3], "w"))
print(f"ferrolm ppl {p['ppl']:.3f} on this directory")
PY
  python3 tools/oracle/mlx_load_check.py "$out" --expect "$own/ours.json"
}
# The three cases side by side (each is mostly one core: mlx-lm's CPU runs), each one's
# output kept apart and shown in order; any failure fails the script.
cases=("bf16:8" "4" "synthetic")
pids=()
for i in "${!cases[@]}"; do
  (set -euo pipefail; check_case "${cases[i]}") >"$tmp/case$i.log" 2>&1 &
  pids+=($!)
done
failed=0
for i in "${!cases[@]}"; do
  wait "${pids[i]}" || failed=1
  cat "$tmp/case$i.log"
done
[[ $failed == 0 ]] || { echo "mlx-check: a case failed" >&2; exit 1; }
echo "mlx-check: all OK"
