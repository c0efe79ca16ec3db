#!/usr/bin/env bash
# The KV cache schemes' speed rows of docs/kv.md (issue 30), on a GPU machine:
#   1. decode at depth: `ferrolm bench --kv S --depth D` per scheme and depth, and with
#      LLAMA_BENCH llama.cpp's llama-bench at the same depth with f16 and q8_0 caches (-fa 1);
#   2. serving at a fixed KV budget (SERVE_BUDGET set): `ferrolm serve --kv S --kv-memory B`
#      per scheme in SERVE_SCHEMES, driven by scripts/serve-bench.py with STREAMS clients of
#      2,800-word prompts (~3k tokens) and 256 new tokens (4k-context streams); from
#      /metrics the most requests running at once, the most KV blocks held and the
#      preemptions, and the aggregate output tokens/s and engine steps.
# Reports (JSON) in $OUT, a table on stdout.
#   usage: scripts/kv-bench.sh BIN_DIR MODEL.gguf
#   env:   DEPTHS         depths (default "1024 32768")
#          SCHEMES        decode schemes (default "bf16 affine:8 affine:4 turbo:k8v3")
#          REPEATS        ferrolm bench --repeats / llama-bench -r (default 3)
#          LLAMA_BENCH    a llama.cpp llama-bench (docs/peers.md), optional
#          SERVE_BUDGET   --kv-memory for part 2 (e.g. 8G); unset: part 2 skipped
#          SERVE_SCHEMES  (default "bf16 turbo:k8v3"), STREAMS (default 256)
#          OUT            (default /tmp/kv-bench)
set -uo pipefail
bin=${1:?usage: kv-bench.sh BIN_DIR MODEL.gguf}
model=${2:?usage: kv-bench.sh BIN_DIR MODEL.gguf}
here=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-/tmp/kv-bench}
reps=${REPEATS:-3}
mkdir -p "$out"
name() { echo "${1//:/_}"; }  # no colon in a file name (device transfers refuse them)
for d in ${DEPTHS:-1024 32768}; do
  for s in ${SCHEMES:-bf16 affine:8 affine:4 turbo:k8v3}; do
    "$bin/ferrolm" bench --device cuda --model "$model" --kv "$s" --depth "$d" --prompt-tokens 64 \
      --gen-tokens 128 --repeats "$reps" --json >"$out/ferrolm-$d-$(name "$s").json" 2>"$out/ferrolm-$d-$(name "$s").err" ||
      echo "ferrolm --kv $s at depth $d failed: $(tail -1 "$out/ferrolm-$d-$(name "$s").err")" >&2
  done
  if [[ -n ${LLAMA_BENCH:-} ]]; then
    for c in f16 q8_0; do
      "$LLAMA_BENCH" -m "$model" -ngl 99 -fa 1 -ctk "$c" -ctv "$c" -d "$d" -p 0 -n 128 -r "$reps" -o json \
        >"$out/llama-$d-$c.json" 2>"$out/llama-$d-$c.err" || echo "llama-bench $c at depth $d failed" >&2
    done
  fi
done
if [[ -n ${SERVE_BUDGET:-} ]]; then
  for s in ${SERVE_SCHEMES:-bf16 turbo:k8v3}; do
    "$bin/ferrolm" serve --device cuda --model "$model" --port 18090 --kv "$s" --kv-memory "$SERVE_BUDGET" \
      --max-batch "${STREAMS:-256}" --max-context 4096 >"$out/serve-$(name "$s").log" 2>&1 &
    pid=$!
    python3 - "$out/serve-$(name "$s").peak" <<'PY' &
import json, re, sys, time, urllib.request
peak, t0 = {"running": 0, "kv_blocks_used": 0, "preemptions": 0}, time.time()
names = {"running": "ferrolm_requests_running", "kv_blocks_used": "ferrolm_kv_blocks_used",
         "preemptions": "ferrolm_preemptions_total"}
while time.time() - t0 < 900:
    try:
        m = urllib.request.urlopen("http://127.0.0.1:18090/metrics", timeout=1).read().decode()
        for k, n in names.items():
            peak[k] = max(peak[k], int(float(re.search(rf"^{n} (\S+)", m, re.M).group(1))))
        open(sys.argv[1], "w").write(json.dumps(peak))
    except Exception:
        pass
    time.sleep(0.25)
PY
    poll=$!
    for _ in $(seq 300); do
      python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:18090/health', timeout=1)" 2>/dev/null && break
      sleep 1
    done
    python3 "$here/scripts/serve-bench.py" --url http://127.0.0.1:18090 --concurrency "${STREAMS:-256}" \
      --prompt-tokens 2800 --max-tokens 256 --requests-per-client 1 >"$out/serve-$(name "$s").json" ||
      echo "serve-bench --kv $s failed" >&2
    kill $poll 2>/dev/null
    kill -TERM $pid
    wait $pid
  done
fi
python3 - "$out" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
print("| engine | cache | depth | decode tok/s | prefill tok/s | first token s |")
print("|---|---|---|---|---|---|")
for p in sorted(glob.glob(os.path.join(out, "ferrolm-*.json"))):
    try:
        j = json.load(open(p))
    except ValueError:
        continue
    print(f"| ferrolm | {j['kv_scheme']} | {j['depth']} | {j['decode_tps']:.1f} | {j['prefill_tps']:.1f} | {j['first_token_seconds']:.2f} |")
for p in sorted(glob.glob(os.path.join(out, "llama-*.json"))):
    try:
        rows = json.load(open(p))
    except ValueError:
        continue
    for r in rows:
        if r.get("n_gen", 0) > 0:
            print(f"| llama.cpp | {r.get('type_k')} | {r.get('n_depth')} | {r['avg_ts']:.1f} | | |")
for p in sorted(glob.glob(os.path.join(out, "serve-*.json"))):
    s = os.path.basename(p)[len("serve-"):-len(".json")]
    peak = json.load(open(p[:-5] + ".peak")) if os.path.exists(p[:-5] + ".peak") else {}
    for lv in json.load(open(p))["levels"]:
        steps = lv.get("engine", {}).get("steps", "?")
        print(f"| ferrolm serve {s} | {lv['concurrency']} clients: at most {peak.get('running', '?')} running, "
              f"{peak.get('kv_blocks_used', '?')} KV blocks held, {peak.get('preemptions', '?')} preemptions, "
              f"{steps} steps | 4k | {lv['output_tokens_per_s']:.1f} aggregate | | errors {lv['errors']} |")
PY
