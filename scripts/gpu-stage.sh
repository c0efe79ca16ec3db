#!/usr/bin/env bash
# Prepare gpu-bin/ (git-ignored) for the GPU machine, whose calls carry at most 64 MiB each:
#   gpu-bin/ferrolm, gpu-bin/cuda_parity   stripped x86-64 binaries (--profile gpu)
#   gpu-bin/m1/smol.part1, gpu-bin/m2/smol.part2   the SmolLM2 GGUF in two parts
#   gpu-bin/g1 … g5/gemma.partN                     the Gemma 3 270M GGUF in five parts
# Then, in device calls made back to back (a warm machine keeps /root for ~30 s):
#   call 1, carry [gpu-bin/ferrolm, gpu-bin/cuda_parity, gpu-bin/m1]:
#     mkdir -p /root/fh/models /root/gb && cp gpu-bin/m1/smol.part1 /root/fh/ && cp gpu-bin/ferrolm gpu-bin/cuda_parity /root/gb/
#   call 2, carry [gpu-bin/m2]:
#     cat /root/fh/smol.part1 gpu-bin/m2/smol.part2 > /root/fh/models/SmolLM2-135M-Instruct.Q4_1.gguf
#   calls 3-6, carry [gpu-bin/gN] (N = 1 … 4): mkdir -p /root/g && cp gpu-bin/gN/* /root/g/
#   call 7, carry [gpu-bin/g5]:
#     cat /root/g/gemma.part? gpu-bin/g5/gemma.part4 > /root/fh/models/gemma-3-270m-q4_k_m.gguf
#     FERROLM_HOME=/root/fh bash scripts/gpu-check.sh /root/gb
# Fewer calls: `scripts/gpu-pack.sh` after this script packs the same things into parcels of
# ~62 MB (the binaries and kernels with the first model bytes, then the models' rest), each
# taken by `scripts/gpu-unpack.sh` at the start of a call that does work (Session 30 ran its
# whole GPU plan in seven such calls back to back).
# (`ferrolm kernels` started in the background in call 1, `setsid nohup … &`, has the
# kernels compiled by call 7.)
# A run on the synthetic 1B model alone needs one call: gpu-bin/tok/ holds a 1.7 MB GGUF with
# SmolLM2's metadata and no tensors (tools/gpu/tokenizer_gguf.py), all `ferrolm convert
# --synthetic` reads from the default model; carry [gpu-bin/ferrolm, gpu-bin/cuda_parity,
# gpu-bin/tok] and run
#     mkdir -p /root/fh/models && cp gpu-bin/tok/*.gguf /root/fh/models/
#     FERROLM_HOME=/root/fh gpu-bin/ferrolm convert --synthetic llama-3.2-1b --quantize 4 --output /root/m1b
# (the same directory, byte for byte, as with the real file), e.g. for kernel variants A/B'd
# by scripts/lab/gpu-ab.sh. Tests and benches of SmolLM2 itself need the real file.
# With LAB=1 also gpu-bin/timings (crates/lab, the engine built again with its `lab`
# feature: a few more minutes), for `timings few qgemm` and the like.
# With KERNEL_CACHE=1 also gpu-bin/m2/kernels.tar.xz (~7 MB): every kernel variant compiled
# here for sm_90 with NVRTC (`ferrolm kernels --arch sm_90 --prune`, no GPU needed; kept in
# gpu-bin/khome, so a later staging compiles only what changed: ~13 min on 2 cores from
# empty). In call 2, `tar -xJf gpu-bin/m2/kernels.tar.xz -C /root/fh` before anything else
# then spares the GPU machine the ~75 s its own `ferrolm kernels` takes after each cold
# start (gpu-check's then finds everything cached). The CUBINs come from the PyPI NVRTC of
# the CUDA 13.0 line, the GPU machine's own; they load there (176 of 176
# cached, gpu-check in 308 s; docs/perf-log.md). A kernel's cache key hashes every header too, so a change to
# any .cuh makes the whole archive stale: rebuild it (then every variant recompiles, ~13 min).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --profile gpu -p ferrolm-cli
exe=$(cargo test --profile gpu -p ferrolm-engine --features cuda-tests --test cuda_parity --no-run --message-format=json 2>/dev/null |
  python3 scripts/test-exe.py cuda_parity)
mkdir -p gpu-bin/m1 gpu-bin/m2
cp "${CARGO_TARGET_DIR:-target}"/gpu/ferrolm gpu-bin/ferrolm
cp "$exe" gpu-bin/cuda_parity
model=${FERROLM_HOME:-$HOME/.cache/ferrolm}/models/SmolLM2-135M-Instruct.Q4_1.gguf
[[ -f $model ]] || "${CARGO_TARGET_DIR:-target}"/gpu/ferrolm inspect >/dev/null
mkdir -p gpu-bin/tok
python3 -c 'import gguf' 2>/dev/null || python3 -m pip install --quiet --disable-pip-version-check gguf
python3 tools/gpu/tokenizer_gguf.py "$model" "gpu-bin/tok/$(basename "$model")"
head -c 41943040 "$model" > gpu-bin/m1/smol.part1
tail -c +41943041 "$model" > gpu-bin/m2/smol.part2
gemma=$(dirname "$model")/gemma-3-270m-q4_k_m.gguf
[[ -f $gemma ]] || scripts/fetch-test-models.sh
rm -rf gpu-bin/g[1-5] && mkdir -p gpu-bin/g1 gpu-bin/g2 gpu-bin/g3 gpu-bin/g4 gpu-bin/g5
split -b 52000000 -d -a 1 "$gemma" gpu-bin/gemma.part
for i in 0 1 2 3 4; do mv "gpu-bin/gemma.part$i" "gpu-bin/g$((i + 1))/"; done
if [[ ${LAB:-0} == 1 ]]; then
  cargo build --profile gpu -p ferrolm-lab --bin timings
  cp "${CARGO_TARGET_DIR:-target}"/gpu/timings gpu-bin/timings
fi
if [[ ${KERNEL_CACHE:-0} == 1 ]]; then
  source scripts/nvrtc-env.sh
  FERROLM_HOME=gpu-bin/khome "${CARGO_TARGET_DIR:-target}"/gpu/ferrolm kernels --arch sm_90 --prune
  tar -C gpu-bin/khome -cf - kernels | xz -T0 -6 > gpu-bin/m2/kernels.tar.xz
fi
ls -la gpu-bin gpu-bin/m1 gpu-bin/m2 gpu-bin/g[1-5] gpu-bin/tok
