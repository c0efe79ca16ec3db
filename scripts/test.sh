#!/usr/bin/env bash
# All of ferrolm's tests: the Rust test suite (parity with committed goldens, exact codec
# tests, bad-input tests, CLI tests, every CUDA kernel compiled with NVRTC for sm_90) and
# the proof that mlx-lm loads `ferrolm convert` output. Needs no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-test-models.sh
# NVRTC for the kernel compile test.
source scripts/nvrtc-env.sh
cargo test --workspace --release
# The GPU test target must compile here too (it runs only on a GPU: scripts/gpu-check.sh).
cargo build --release -p ferrolm-engine --features cuda-tests --test cuda_parity
scripts/mlx-check.sh
