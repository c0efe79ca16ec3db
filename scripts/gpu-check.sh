#!/usr/bin/env bash
# GPU test suite and benchmarks, on a machine with an NVIDIA GPU and no Rust toolchain.
# Build the binaries elsewhere (x86-64) and bring them in BIN_DIR (default gpu-bin/):
#   cargo build --profile gpu -p ferrolm-cli && cp target/gpu/ferrolm gpu-bin/
#   cargo test --profile gpu -p ferrolm-engine --features cuda-tests --test cuda_parity --no-run
#   cp target/gpu/deps/cuda_parity-<hash> gpu-bin/cuda_parity
# The SmolLM2 GGUF must be in $FERROLM_HOME/models (default ~/.cache/ferrolm/models).
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
bench() { "$bin/ferrolm" bench --device cuda --model "$model" --json "$@" 2>>"$log"; }
cpu_bench() { "$bin/ferrolm" bench --device cpu --model "$model" --json --repeats 1 "$@" 2>>"$log"; }
b512=$(bench --prompt-tokens 512 --gen-tokens 128 --repeats 5) || status=1
c512=$(cpu_bench --prompt-tokens 512 --gen-tokens 128) || status=1
python3 - "$b512" "$c512" <<'PY'
import json, sys
rows = []
for label, s in zip(["cuda", "cpu (same machine)"], sys.argv[1:]):
    try:
        j = json.loads(s)
        rows.append(f"| {label} | {j['prefill_tps']:.0f} | {j['decode_tps']:.1f} |")
    except Exception as e:
        rows.append(f"| {label} | failed | {e} |")
print("| SmolLM2-135M Q4_1 | prefill pp512 tok/s | decode tg128 tok/s |\n|---|---|---|\n" + "\n".join(rows))
PY
exit $status
