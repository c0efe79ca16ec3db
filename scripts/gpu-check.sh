#!/usr/bin/env bash
# GPU test suite and benchmarks, on a machine with an NVIDIA GPU and no Rust toolchain.
# Build the binaries elsewhere (x86-64) and bring them in BIN_DIR (default gpu-bin/):
#   cargo build --profile gpu -p ferrolm-cli && cp target/gpu/ferrolm gpu-bin/
#   cargo test --profile gpu -p ferrolm-engine --features cuda-tests --test cuda_parity --no-run
#   cp target/gpu/deps/cuda_parity-<hash> gpu-bin/cuda_parity
# The SmolLM2 GGUF must be in $FERROLM_HOME/models (default ~/.cache/ferrolm/models); the
# 1B shape is generated (synthetic weights) into $M1B; the PyTorch peer needs torch and
# transformers (tools/peers/torch_bench.py).
# Prints a short table last; full logs go to $OUT (or /tmp) as gpu-check.log.
set -uo pipefail
bin=${1:-gpu-bin}
log=${OUT:-/tmp}/gpu-check.log
model=${FERROLM_HOME:-$HOME/.cache/ferrolm}/models/SmolLM2-135M-Instruct.Q4_1.gguf
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$log"
status=0
echo "== parity tests" | tee -a "$log"
"$bin/cuda_parity" --test-threads=1 --nocapture >>"$log" 2>&1 || status=1
grep -E "^test |rel err|argmax|greedy|test result" "$log" | grep -vE "rel err [0-9.]+e-0[4-9]" | tail -40
echo "== bench" | tee -a "$log"
# SmolLM2 (real weights) and the Llama-3.2-1B shape (SYNTHETIC weights, generated here),
# at a 512-token prompt and at depth; then the PyTorch peer at the same shapes.
m1b=${M1B:-/tmp/ferrolm-m1b}
[[ -f $m1b/config.json ]] || "$bin/ferrolm" convert --synthetic llama-3.2-1b --quantize 4 --output "$m1b" >>"$log" 2>&1 || status=1
results=()
bench() { "$bin/ferrolm" bench --device cuda --json --repeats 5 "$@" 2>>"$log" || echo '{}'; }
results+=("SmolLM2-135M Q4_1|$(bench --model "$model")")
results+=("SmolLM2-135M Q4_1, depth 7424|$(bench --model "$model" --depth 7424)")
results+=("1B shape 4-bit (synthetic)|$(bench --model "$m1b")")
results+=("1B shape 4-bit (synthetic), depth 8192|$(bench --model "$m1b" --depth 8192)")
python3 - "${results[@]}" <<'PY'
import json, sys
print("| run | prefill tok/s | decode tok/s | decode weight bandwidth | of copy bandwidth |")
print("|---|---|---|---|---|")
for arg in sys.argv[1:]:
    name, _, js = arg.partition("|")
    try:
        j = json.loads(js)
        bw, r = j.get("effective_bandwidth_bytes_per_s"), j.get("bandwidth_ratio")
        cells = [f"{j['prefill_tps']:.0f}", f"{j['decode_tps']:.1f}"]
        cells += [f"{bw / 1e12:.3f} TB/s", f"{100 * r:.1f}% of {j['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s"] if bw else ["–", "–"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    except Exception as e:
        print(f"| {name} | failed: {e!r} | | | |")
PY
# The PyTorch peer last (torch.compile takes a minute per shape).
peer=$(dirname "$0")/../tools/peers/torch_bench.py
for shape in smollm2-135m llama-3.2-1b; do
  echo "PyTorch bf16 $shape (random weights): $(timeout 240 python3 "$peer" --shape $shape 2>>"$log" | tail -1)"
done
exit $status
