#!/usr/bin/env bash
# Prepare gpu-bin/ (git-ignored) for the GPU machine, whose calls carry at most 64 MiB each:
#   gpu-bin/ferrolm, gpu-bin/cuda_parity   stripped x86-64 binaries (--profile gpu)
#   gpu-bin/m1/smol.part1, gpu-bin/m2/smol.part2   the SmolLM2 GGUF in two parts
# Then, in two device calls made back to back (a warm machine keeps /root for ~30 s):
#   call 1, carry [gpu-bin/ferrolm, gpu-bin/cuda_parity, gpu-bin/m1]:
#     mkdir -p /root/fh/models /root/gb && cp gpu-bin/m1/smol.part1 /root/fh/ && cp gpu-bin/ferrolm gpu-bin/cuda_parity /root/gb/
#   call 2, carry [gpu-bin/m2]:
#     cat /root/fh/smol.part1 gpu-bin/m2/smol.part2 > /root/fh/models/SmolLM2-135M-Instruct.Q4_1.gguf
#     FERROLM_HOME=/root/fh bash scripts/gpu-check.sh /root/gb
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --profile gpu -p ferrolm-cli
exe=$(cargo test --profile gpu -p ferrolm-engine --features cuda-tests --test cuda_parity --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json,sys; print([j["executable"] for j in map(json.loads, sys.stdin) if j.get("executable") and "cuda_parity" in j["executable"]][-1])')
mkdir -p gpu-bin/m1 gpu-bin/m2
cp target/gpu/ferrolm gpu-bin/ferrolm
cp "$exe" gpu-bin/cuda_parity
model=${FERROLM_HOME:-$HOME/.cache/ferrolm}/models/SmolLM2-135M-Instruct.Q4_1.gguf
[[ -f $model ]] || target/gpu/ferrolm inspect >/dev/null
head -c 41943040 "$model" > gpu-bin/m1/smol.part1
tail -c +41943041 "$model" > gpu-bin/m2/smol.part2
ls -la gpu-bin gpu-bin/m1 gpu-bin/m2
