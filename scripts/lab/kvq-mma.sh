#!/usr/bin/env bash
# The lab's tensor-core attention over quantized KV rows (crates/lab/kernels/kvq_mma.cuh)
# as a kernel directory for FERROLM_KERNEL_DIR: DIR/kv_quant.cu is the product's kv_quant.cu
# with the lab text spliced in before attention_q and attention_q / attention_q_decode
# calling attend_part_mma. On the GPU machine, with the same binaries:
#   FERROLM_KERNEL_DIR=DIR cuda_parity kv_quant      the parity tests over the variant
#   scripts/lab/gpu-ab.sh BIN MODEL 2 DIR             A/B against the built-in kernels
#   usage: scripts/lab/kvq-mma.sh DIR
set -euo pipefail
dir=${1:?usage: kvq-mma.sh DIR}
here=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$dir"
python3 - "$here/crates/engine/kernels/kv_quant.cu" "$here/crates/lab/kernels/kvq_mma.cuh" "$dir/kv_quant.cu" <<'PY'
import sys
src, lab, out = sys.argv[1:4]
s, text = open(src).read(), open(lab).read()
anchor = "// attention.cu's attention_split over quantized rows for qb"
calls = ["attend_part(C, q + row0 * hd,", "attend_part(C, s_q, table,"]
assert s.count(anchor) == 1 and all(s.count(c) == 1 for c in calls), "kv_quant.cu changed: update kvq-mma.sh"
s = s.replace(anchor, text + "\n" + anchor)
for c in calls:
    s = s.replace(c, c.replace("attend_part(", "attend_part_mma("))
open(out, "w").write(s)
PY
echo "$dir/kv_quant.cu"
