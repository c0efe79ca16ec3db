#!/usr/bin/env bash
# Side-by-side CPU benchmark: ferrolm bench and (when LLAMA_BENCH points at a llama-bench
# binary built as docs/peers.md describes) llama.cpp on the same GGUF, alternating runs in
# one session so both see the same machine state. Prints medians and ratios.
#   scripts/cpu-bench.sh [MODEL.gguf] [ROUNDS]   (default: the SmolLM2 default model, 3)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p ferrolm-cli
bin=${CARGO_TARGET_DIR:-target}/release/ferrolm
model=${1:-${FERROLM_HOME:-$HOME/.cache/ferrolm}/models/SmolLM2-135M-Instruct.Q4_1.gguf}
rounds=${2:-3}
threads=$(nproc)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for r in $(seq "$rounds"); do
  $bin --threads "$threads" bench --model "$model" --prompt-tokens 512 --gen-tokens 128 --repeats 3 --json > "$out/ferrolm.$r.json"
  if [[ -n ${LLAMA_BENCH:-} ]]; then
    "$LLAMA_BENCH" -m "$model" -t "$threads" -p 512 -n 128 -r 3 -o json > "$out/llama.$r.json" 2>/dev/null
  fi
done
python3 - "$out" "$rounds" "$model" "$threads" <<'PY'
import json, statistics, sys, os
out, rounds, model, threads = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
f = [json.load(open(f"{out}/ferrolm.{r}.json")) for r in range(1, rounds + 1)]
fp = statistics.median(x["prefill_tps"] for x in f)
fd = statistics.median(x["decode_tps"] for x in f)
rss = max(x["peak_rss_bytes"] for x in f)
base = f[0]["model_file_bytes"] + f[0]["kv_cache_bytes"]
print(f"model {os.path.basename(model)}, {threads} threads, {rounds} rounds (ferrolm: median of 3 runs per round)")
print(f"| engine | prefill pp512 tok/s | decode tg128 tok/s |")
print(f"|---|---|---|")
print(f"| ferrolm | {fp:.1f} | {fd:.1f} |")
if os.path.exists(f"{out}/llama.1.json"):
    lp, ld = [], []
    for r in range(1, rounds + 1):
        for t in json.load(open(f"{out}/llama.{r}.json")):
            (lp if t["n_prompt"] > 0 else ld).append(t["avg_ts"])
    lp, ld = statistics.median(lp), statistics.median(ld)
    print(f"| llama.cpp | {lp:.1f} | {ld:.1f} |")
    print(f"| ratio ferrolm/llama.cpp | {fp/lp:.2f} | {fd/ld:.2f} |")
print(f"ferrolm peak RSS {rss/2**20:.1f} MiB = {rss/base:.2f}x (model file {f[0]['model_file_bytes']/2**20:.1f} MiB + KV {f[0]['kv_cache_bytes']/2**20:.1f} MiB)")
PY
