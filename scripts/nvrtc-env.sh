# Sourced (bash) by scripts/test.sh and scripts/gpu-stage.sh: puts NVRTC of the CUDA 13.0
# line from PyPI (it matches the GPU machine's driver) on LD_LIBRARY_PATH, where cudarc
# loads it at run time, installing it first if no site-packages directory has it.
nvrtc_dir() {
  python3 - <<'PY'
import glob, os, site
for d in site.getsitepackages() + [site.getusersitepackages()]:
    for lib in sorted(glob.glob(os.path.join(d, "nvidia", "*", "lib", "libnvrtc.so.*"))):
        print(os.path.dirname(lib)); raise SystemExit
PY
}
nvrtc_lib=$(nvrtc_dir)
if [[ -z $nvrtc_lib ]]; then
  python3 -m pip install --quiet --disable-pip-version-check "nvidia-cuda-nvrtc==13.0.*"
  nvrtc_lib=$(nvrtc_dir)
fi
export LD_LIBRARY_PATH="$nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
