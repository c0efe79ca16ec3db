#!/usr/bin/env bash
# Run the lab's binaries (crates/lab: probes and timings, not the product) on the GPU
# machine, which has no Rust toolchain. Build them here (x86-64, no GPU needed), stripped
# as gpu-stage.sh builds gpu-bin/ferrolm, and put them beside it in gpu-bin/ (git-ignored):
#   cargo build --profile gpu -p ferrolm-lab
#   mkdir -p gpu-bin/lab && cp target/gpu/probes target/gpu/timings gpu-bin/lab/
# Then one device call (scripts/gpu-stage.sh's header says how calls carry files; each
# carries at most 64 MiB, and the two binaries are a few MB), carry [gpu-bin/lab]:
#   bash scripts/lab/run.sh gpu-bin/lab all
# or one binary with its own arguments:
#   bash scripts/lab/run.sh gpu-bin/lab probes sync pdl
#   bash scripts/lab/run.sh gpu-bin/lab timings gemv --copies 1
# No model is needed. The kernels compile with NVRTC on first use (cached under
# $FERROLM_HOME/kernels); a kernel variant is timed by pointing FERROLM_KERNEL_DIR at its
# directory (timings --timing-only where it computes something else). Each binary's output
# also goes to ${OUT:-/tmp}/lab-<binary>.log; record what it says in docs/perf-log.md.
#   usage: scripts/lab/run.sh BIN_DIR (all | probes [ARGS...] | timings [ARGS...])
set -uo pipefail
bin=${1:?usage: scripts/lab/run.sh BIN_DIR (all | probes [ARGS...] | timings [ARGS...])}
what=${2:-all}
shift $(($# < 2 ? $# : 2))
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null
run() {  # binary, then its arguments
  local b=$1
  shift
  "$bin/$b" "$@" 2>&1 | tee "$out/lab-$b.log"
  return "${PIPESTATUS[0]}"
}
case $what in
  all) run probes all; p=$?; run timings all; t=$?; exit $((p > t ? p : t)) ;;
  probes | timings) run "$what" "$@" ;;
  *) echo "unknown: $what (all, probes or timings)" >&2; exit 2 ;;
esac
