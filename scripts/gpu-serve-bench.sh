#!/usr/bin/env bash
# Serving side by side: `ferrolm serve` and (when LLAMA_SERVER is set) llama.cpp's
# llama-server on the same GGUF, each driven by scripts/serve-bench.py at the same
# concurrency levels; one JSON per server in $OUT (default /tmp), a table on stdout.
#   usage: scripts/gpu-serve-bench.sh BIN_DIR MODEL.gguf
#   env:   LLAMA_SERVER   a llama.cpp llama-server (docs/peers.md; LD_LIBRARY_PATH as it needs)
#          LEVELS         concurrency levels (default 1,8,32,64)
#          PROMPT, TOKENS prompt words and generated tokens per request (default 128, 128)
#          REQUESTS       requests per client (default 4)
#          DEVICE         ferrolm's --device (default cuda)
#          CTX            context per request slot (default 1024)
# llama-server gets -np (the largest level) slots of CTX tokens each with continuous
# batching and flash attention; ferrolm serve --max-batch the same.
set -uo pipefail
bin=${1:?usage: gpu-serve-bench.sh BIN_DIR MODEL.gguf}
model=${2:?usage: gpu-serve-bench.sh BIN_DIR MODEL.gguf}
here=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-/tmp}
mkdir -p "$out"
levels=${LEVELS:-1,8,32,64}
np=$(tr ',' '\n' <<<"$levels" | sort -n | tail -1)
ctx=${CTX:-1024}
bench() { python3 "$here/scripts/serve-bench.py" --url "http://127.0.0.1:$1" --concurrency "$levels" \
  --prompt-tokens "${PROMPT:-128}" --max-tokens "${TOKENS:-128}" --requests-per-client "${REQUESTS:-4}" > "$2"; }
# Wait until something answers /health on the port (a server loading its model).
ready() {
  for _ in $(seq 300); do
    python3 -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$1/health', timeout=1)" \
      2>/dev/null && return 0
    sleep 1
  done
  return 1
}
status=0
"$bin/ferrolm" serve --device "${DEVICE:-cuda}" --model "$model" --port 18080 --max-batch "$np" \
  --max-context "$ctx" > "$out/ferrolm-serve.log" 2>&1 &
pid=$!
if ready 18080; then bench 18080 "$out/serve-ferrolm.json" || status=1; else echo "ferrolm serve did not start" >&2; status=1; fi
kill -TERM $pid; wait $pid
if [[ -n ${LLAMA_SERVER:-} ]]; then
  "$LLAMA_SERVER" -m "$model" -ngl 99 -fa on -np "$np" -cb -c $((np * ctx)) --port 18081 \
    > "$out/llama-server.log" 2>&1 &
  pid=$!
  if ready 18081; then bench 18081 "$out/serve-llama.json" || status=1; else echo "llama-server did not start" >&2; status=1; fi
  kill -TERM $pid; wait $pid
fi
python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
print("| server | streams | output tok/s | TTFT p50 s | ITL p50 ms | ITL mean ms | errors | engine step / forward ms |")
print("|---|---|---|---|---|---|---|---|")
for name in ("ferrolm", "llama"):
    path = os.path.join(out, f"serve-{name}.json")
    if not os.path.exists(path):
        continue
    for lv in json.load(open(path))["levels"]:
        ttft, itl, eng = lv["ttft_s"]["p50"], lv["itl_s"]["p50"], lv.get("engine")
        mean = lv.get("itl_mean_s")
        eng = f"{eng['step_ms']:.2f} / {eng['forward_ms']:.2f}" if eng else "–"
        print(f"| {name} | {lv['concurrency']} | {lv['output_tokens_per_s']:.1f} | "
              f"{ttft if ttft is None else round(ttft, 3)} | {itl if itl is None else round(itl * 1e3, 2)} | "
              f"{mean if mean is None else round(mean * 1e3, 3)} | {lv['errors']} | {eng} |")
PY
exit $status
