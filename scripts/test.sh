#!/usr/bin/env bash
# All of ferrolm's tests: the Rust test suite (parity with committed goldens, exact codec
# tests, bad-input tests, CLI tests, every CUDA kernel compiled with NVRTC for sm_90) and
# the proof that mlx-lm loads `ferrolm convert` output. Needs no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-test-models.sh
# NVRTC for the kernel compile test: the CUDA 13.0 line from PyPI (matches the GPU
# machine's driver), found through LD_LIBRARY_PATH as cudarc loads it at run time.
nvrtc_dir() {
  python3 - <<'PY'
import glob, os, site
for d in site.getsitepackages() + [site.getusersitepackages()]:
    for lib in sorted(glob.glob(os.path.join(d, "nvidia", "*", "lib", "libnvrtc.so.*"))):
        print(os.path.dirname(lib)); raise SystemExit
PY
}
dir=$(nvrtc_dir)
if [[ -z $dir ]]; then
  python3 -m pip install --quiet --disable-pip-version-check "nvidia-cuda-nvrtc==13.0.*"
  dir=$(nvrtc_dir)
fi
export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
cargo test --workspace --release
# The GPU test target must compile here too (it runs only on a GPU: scripts/gpu-check.sh).
cargo build --release -p ferrolm-engine --features cuda-tests --test cuda_parity
scripts/mlx-check.sh
