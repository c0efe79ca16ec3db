#!/usr/bin/env bash
# The few-token GEMM with windowed x loads (crates/lab/kernels/few_win.cuh) as a kernel
# directory for FERROLM_KERNEL_DIR: DIR/gemm_small.cuh is the product's with the lab text
# spliced in after chunk_mma and the one-tile full chunks calling chunk_mma_win. WIN_M1 and
# WIN_GLU_M1 (environment, defaults in the lab text) set the windows. On the GPU machine,
# with the same binaries:
#   FERROLM_KERNEL_DIR=DIR timings few          bits against the tiled kernel, µs a launch
#   FERROLM_KERNEL_DIR=DIR cuda_parity gemm     the parity tests over the variant
#   usage: [WIN_M1=N] [WIN_GLU_M1=N] scripts/lab/few-win.sh DIR
set -euo pipefail
dir=${1:?usage: few-win.sh DIR}
here=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$dir"
python3 - "$here/crates/engine/kernels/gemm_small.cuh" "$here/crates/lab/kernels/few_win.cuh" "$dir/gemm_small.cuh" <<'PY'
import os, sys
src, lab, out = sys.argv[1:4]
s, text = open(src).read(), open(lab).read()
for name in ("WIN_M1", "WIN_GLU_M1"):
    if os.environ.get(name):
        text = "#define %s %d\n" % (name, int(os.environ[name])) + text
anchor = "// grid (ceil(rows / 8)), block"
call = "if (c < nchunk) chunk_mma<MT, NM>(acc, cur, x, c, kend, cols, m, lane);"
win = """if (c < nchunk) {
            if constexpr (MT == 1) {
                if ((c + 1) * CHUNK_K <= kend) chunk_mma_win<NM>(acc, cur, x, c, cols, m, lane);
                else chunk_mma<MT, NM>(acc, cur, x, c, kend, cols, m, lane);
            } else {
                chunk_mma<MT, NM>(acc, cur, x, c, kend, cols, m, lane);
            }
        }"""
assert s.count(anchor) == 1 and s.count(call) == 1, "gemm_small.cuh changed: update few-win.sh"
s = s.replace(anchor, text + "\n" + anchor).replace(call, win)
open(out, "w").write(s)
PY
echo "$dir/gemm_small.cuh"
