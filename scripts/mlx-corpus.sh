#!/usr/bin/env bash
# ferrolm against mlx-lm on models mlx-lm's own converter writes (tools/oracle/mlx_corpus.py):
# SmolLM2-135M-Instruct as a bf16 Hugging Face directory (`ferrolm convert --quantize bf16`),
# quantized by mlx_lm.convert at bits 2/3/4/6/8 × groups 32/64/128 and with each of its
# mixed-precision recipes (mixed_2_6, mixed_3_4, mixed_3_6, mixed_4_6, group 64); then the
# teacher-forced NLL of the golden prose text from mlx-lm (float32, CPU) and from ferrolm
# (`perplexity --json`) on each directory. Passes when, on every directory mlx-lm writes,
# mean |ΔNLL| ≤ 0.01 nats and the argmax agrees on ≥ 99% of the positions whose mlx-lm top-2
# margin > 0.05; a combination mlx-lm refuses is listed as refused, and a model quantized
# past being one (mlx-lm's perplexity > 1000: SmolLM2 at 2 bits, groups 32 and 64) is listed
# and not judged. Needs pip "mlx[cpu]" mlx-lm (installed if missing). Cases run side by
# side, one per core.
#   usage: scripts/mlx-corpus.sh [CASE...]   (a case: B:G or a recipe name; default all)
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import mlx_lm" 2>/dev/null || python3 -m pip install --quiet "mlx[cpu]" mlx-lm
# FERROLM: a ferrolm binary already built (scripts/test.sh passes its own, whose engine has
# the test features: building the CLI alone here would compile the engine a second time).
[[ -n ${FERROLM:-} ]] || cargo build --release -q -p ferrolm-cli
bin=${FERROLM:-${CARGO_TARGET_DIR:-target}/release/ferrolm}
model=${FERROLM_HOME:-$HOME/.cache/ferrolm}/models/SmolLM2-135M-Instruct.Q4_1.gguf
[[ -f $model ]] || $bin inspect >/dev/null
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -c '
import json, sys
g = json.load(open("crates/engine/tests/goldens/smollm2_hf.json"))
open(sys.argv[1], "w").write(next(t for t in g["texts"] if t["name"] == "prose")["text"])' "$tmp/prose.txt"
$bin convert --input "$model" --output "$tmp/bf16" --quantize bf16 >/dev/null
cases=("$@")
if [[ ${#cases[@]} -eq 0 ]]; then
  for b in 2 3 4 6 8; do for g in 32 64 128; do cases+=("$b:$g"); done; done
  cases+=(mixed_2_6 mixed_3_4 mixed_3_6 mixed_4_6)
fi
# One case: 0 passed, refused or not judged; 1 judged and failed; 2 the converter failed.
run_case() {
  local c=$1 own="$tmp/case-$1"
  local out="$tmp/$c" args rc
  mkdir -p "$own"
  if [[ $c == mixed_* ]]; then args=(--bits 4 --group 64 --predicate "$c"); else args=(--bits "${c%:*}" --group "${c#*:}"); fi
  set +e
  python3 tools/oracle/mlx_corpus.py convert "$tmp/bf16" "$out" "${args[@]}" >"$own/log" 2>&1
  rc=$?
  set -e
  if [[ $rc == 3 ]]; then echo "$c: refused by mlx-lm ($(grep -m1 refuses "$own/log"))"; return 0; fi
  [[ $rc == 0 ]] || { cat "$own/log"; return 2; }
  python3 tools/oracle/mlx_corpus.py score "$out" "$tmp/prose.txt" "$own/mlx.json" 2>/dev/null
  $bin perplexity --model "$out" --file "$tmp/prose.txt" --ctx 4096 --json >"$own/ours.json"
  python3 - "$c" "$own/mlx.json" "$own/ours.json" <<'PY'
import json, math, sys
case, m, o = sys.argv[1], json.load(open(sys.argv[2])), json.load(open(sys.argv[3]))
assert o["targets"] == m["ids"][1:], f"{case}: ferrolm and mlx-lm tokenize the text differently"
d = [abs(a - b) for a, b in zip(o["nll"], m["nll"])]
sure = [i for i, g in enumerate(m["margin"]) if g > 0.05]
agree = sum(o["argmax"][i] == m["argmax"][i] for i in sure)
mean = sum(d) / len(d)
ppl_o, ppl_m = math.exp(sum(o["nll"]) / len(d)), math.exp(sum(m["nll"]) / len(d))
line = f"{case}: mean |dNLL| {mean:.5f}, argmax {agree}/{len(sure)}, ppl ferrolm {ppl_o:.3f} mlx-lm {ppl_m:.3f}"
if ppl_m > 1000:
    # Quantized past being a language model (2-bit rows of 32 or 64 on SmolLM2): its
    # logits are huge and any rounding difference (ferrolm's bf16 KV cache) is amplified.
    print(line + "  (degenerate: not judged)")
    sys.exit(0)
ok = mean <= 0.01 and agree >= 0.99 * len(sure)
print(line + ("" if ok else "  FAIL"))
sys.exit(0 if ok else 1)
PY
}
# Cases side by side, one per core at a time (each is mostly one core: mlx-lm's CPU runs),
# each one's output shown in order.
status=0
jobs_at_once=$(nproc)
for ((i = 0; i < ${#cases[@]}; i += jobs_at_once)); do
  pids=()
  for c in "${cases[@]:i:jobs_at_once}"; do
    (run_case "$c") >"$tmp/case-$c.out" 2>&1 &
    pids+=($!)
  done
  for j in "${!pids[@]}"; do
    rc=0
    wait "${pids[j]}" || rc=$?
    cat "$tmp/case-${cases[i + j]}.out"
    [[ $rc == 2 ]] && exit 1
    [[ $rc == 0 ]] || status=1
  done
done
exit $status
