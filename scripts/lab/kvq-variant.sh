#!/usr/bin/env bash
# One of the lab's variants of the attention over quantized KV rows as a kernel directory
# for FERROLM_KERNEL_DIR: DIR/kv_quant_mma.cuh, in place of the engine's.
# Both are crates/lab/kernels/kvq_lab.cuh, after `#define KVQ_LEAN 0` or 1:
#   wide  the same codes in the same registers in fewer, wider loads (the engine's bits);
#   lean  those loads and ~24% fewer instructions a step (f16 key codes by byte permutes,
#         centroids looked up in pairs, lazy rescaling, row addresses from the step's block
#         entries; not the engine's bits).
# On the GPU machine, with the same binaries (8B shape, docs/kv.md "Speed"):
#   FERROLM_KERNEL_DIR=DIR ferrolm kernels           compile the variant on every core first
#   FERROLM_KERNEL_DIR=DIR cuda_parity kv_quant      the parity tests over the variant
#   BENCH_ARGS="--kv turbo:k8v3 --depth 32768 ..." scripts/lab/gpu-ab.sh BIN MODEL 2 DIR...
#   usage: scripts/lab/kvq-variant.sh wide|lean DIR
set -euo pipefail
name=${1:?usage: kvq-variant.sh wide|lean DIR}
dir=${2:?usage: kvq-variant.sh wide|lean DIR}
here=$(cd "$(dirname "$0")/../.." && pwd)
case $name in
  wide) lean=0 ;;
  lean) lean=1 ;;
  *) echo "kvq-variant.sh: no variant $name (wide or lean)" >&2; exit 1 ;;
esac
mkdir -p "$dir"
{ echo "#define KVQ_LEAN $lean"; cat "$here/crates/lab/kernels/kvq_lab.cuh"; } >"$dir/kv_quant_mma.cuh"
echo "$dir/kv_quant_mma.cuh"
