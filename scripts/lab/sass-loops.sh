#!/usr/bin/env bash
# Instructions per loop iteration of a kernel, without a GPU: FILE compiled here for sm_90
# with NVRTC (pip nvidia-cuda-nvrtc; scripts/nvrtc-env.sh) at full optimization, its
# FUNCTION disassembled (cuobjdump + nvdisasm from PyPI, installed into TOOLS on first use),
# then for each loop (a backward branch) that holds MMAs (HMMA, or wgmma's HGMMA) its length and most frequent
# opcodes. A kernel variant's cost per step before any device time: e.g. kv_quant.cu's
# attention_q_decode at turbo:k8v3, 1,042 instructions per 16-position step at head dim
# 128 (docs/kv.md, "Speed").
#   usage: scripts/lab/sass-loops.sh FILE FUNCTION [DEFINE...]   (DEFINE: NAME=VALUE)
#   env:   KERNEL_DIR  the directory FILE's includes come from (default: FILE's own)
#          ARCH        the target (default sm_90; sm_90a for wgmma kernels, e.g. the lab's
#                      qgemm_wgmma.cu with KERNEL_DIR holding the engine's headers); ptxas's
#                      notes (registers, spills, injected wgmma waits: C7515/C7517) are
#                      printed first
#          TOOLS       where cuobjdump and nvdisasm go (default ~/.cache/ferrolm/cuda-tools)
#          SASS        also write the whole disassembly there (to diff two builds' code)
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
file=${1:?usage: sass-loops.sh FILE FUNCTION [DEFINE...]}
fun=${2:?usage: sass-loops.sh FILE FUNCTION [DEFINE...]}
shift 2
tools=${TOOLS:-$HOME/.cache/ferrolm/cuda-tools}
if [[ ! -x $tools/nvidia/cu13/bin/cuobjdump ]]; then
  # The CUDA 13.0 line has no wheels of these; 13.2's read 13.0's CUBINs.
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --target "$tools" \
    "nvidia-cuda-cuobjdump==13.2.*" "nvidia-cuda-nvdisasm==13.2.*"
fi
export PATH=$tools/nvidia/cu13/bin:$PATH
# shellcheck source=/dev/null
source "$here/scripts/nvrtc-env.sh" >/dev/null
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 - "${KERNEL_DIR:-$(dirname "$file")}" "$file" "$tmp/k.cubin" "$@" <<'PY'
import ctypes, glob, os, re, site, sys
inc, src, out, *defines = sys.argv[1:]
lib = next(l for d in site.getsitepackages() for l in sorted(glob.glob(os.path.join(d, "nvidia", "*", "lib", "libnvrtc.so.*"))))
n = ctypes.CDLL(lib)
prog = ctypes.c_void_p()
assert n.nvrtcCreateProgram(ctypes.byref(prog), open(src).read().encode(), b"k.cu", 0, None, None) == 0
arch = os.environ.get("ARCH", "sm_90")
opts = [("-arch=" + arch).encode(), b"-std=c++17", ("-I" + inc).encode(), b"--ptxas-options=-v"]
opts += [("-D" + d).encode() for d in defines]
r = n.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
size = ctypes.c_size_t()
n.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
log = ctypes.create_string_buffer(size.value)
n.nvrtcGetProgramLog(prog, log)
if r:
    sys.exit(log.value.decode())
for line in log.value.decode().splitlines():
    if re.search(r"Compiling entry|registers|spill|C75", line):
        print(line)
n.nvrtcGetCUBINSize(prog, ctypes.byref(size))
cubin = ctypes.create_string_buffer(size.value)
n.nvrtcGetCUBIN(prog, cubin)
open(out, "wb").write(cubin.raw)
PY
cuobjdump -sass -fun "$fun" "$tmp/k.cubin" >"$tmp/k.sass"
[[ -n ${SASS:-} ]] && cp "$tmp/k.sass" "$SASS"
python3 - "$tmp/k.sass" <<'PY'
import collections, re, sys
ins = []
for line in open(sys.argv[1]):
    m = re.match(r'\s*/\*([0-9a-f]{4,})\*/\s+(.*?);', line)
    if m:
        ins.append((int(m.group(1), 16), m.group(2).strip()))
at = {a: i for i, (a, _) in enumerate(ins)}
print(f"{len(ins)} instructions in all")
for i, (a, text) in enumerate(ins):
    m = re.search(r'BRA\s+(?:\S+,\s*)?0x([0-9a-f]+)', text)
    start = at.get(int(m.group(1), 16)) if m else None
    if start is None or start >= i:
        continue
    ops = collections.Counter(re.sub(r'^@!?U?P\w+\s+', '', t).split()[0].split('.')[0] for _, t in ins[start:i + 1])
    mmas = ops["HMMA"] + ops["HGMMA"]
    if mmas:
        top = ", ".join(f"{k} {v}" for k, v in ops.most_common(16))
        print(f"loop at {ins[start][0]:#x}: {i + 1 - start} instructions, {mmas} MMAs: {top}")
PY
