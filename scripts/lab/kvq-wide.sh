#!/usr/bin/env bash
# The lab's wide-load attention over quantized KV rows (crates/lab/kernels/kvq_wide.cuh) as a
# kernel directory for FERROLM_KERNEL_DIR: DIR/kv_quant_mma.cuh, in place of the engine's.
# The same codes in the same registers as the engine's kernel, so the same output bits. On
# the GPU machine, with the same binaries:
#   FERROLM_KERNEL_DIR=DIR cuda_parity kv_quant      the parity tests over the variant
#                                                    (fused_quantized_decode_is_the_three_kernels_bit_for_bit)
#   scripts/lab/gpu-ab.sh BIN MODEL 2 DIR             A/B against the built-in kernels
# (8B shape, turbo:k8v3 / affine:4 / affine:8 at depth 32768: docs/kv.md "Speed".)
#   usage: scripts/lab/kvq-wide.sh DIR
set -euo pipefail
dir=${1:?usage: kvq-wide.sh DIR}
here=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$dir"
cp "$here/crates/lab/kernels/kvq_wide.cuh" "$dir/kv_quant_mma.cuh"
echo "$dir/kv_quant_mma.cuh"
