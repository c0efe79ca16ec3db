#!/usr/bin/env bash
# A/B of kernel variants in one GPU call: decode tok/s of `ferrolm bench` for the
# built-in kernels and for each variant directory (FERROLM_KERNEL_DIR: its .cu/.cuh
# files replace the built-in ones of the same name), in alternating rounds so that drift
# of the machine hits every variant alike. Prints one row per variant with each round's
# decode tok/s and their median.
#   usage: scripts/lab/gpu-ab.sh BIN_DIR MODEL ROUNDS [VARIANT_DIR ...]
#   env:   BENCH_ARGS (default "--repeats 3"): the timed runs' bench arguments
# A run that fails counts as 0 tok/s (its stderr is not kept; the warm-up's is shown).
# The variants compile on first use (NVRTC), outside the timed runs: one untimed
# `bench --gen-tokens 8` per variant first.
set -uo pipefail
bin=$1 model=$2 rounds=$3
shift 3
variants=(builtin "$@")
run() {  # variant, then bench arguments
  local v=$1
  shift
  if [[ $v == builtin ]]; then "$bin/ferrolm" bench --device cuda --json --model "$model" "$@"
  else FERROLM_KERNEL_DIR=$v "$bin/ferrolm" bench --device cuda --json --model "$model" "$@"; fi
}
for v in "${variants[@]}"; do
  run "$v" --repeats 1 --gen-tokens 8 >/dev/null 2>/tmp/gpu-ab.err || { echo "warm-up of $v failed:"; tail -3 /tmp/gpu-ab.err; }
done
declare -A dec
for ((i = 0; i < rounds; i++)); do
  for v in "${variants[@]}"; do
    # shellcheck disable=SC2086
    j=$(run "$v" ${BENCH_ARGS:---repeats 3} 2>/dev/null) || j='{}'
    dec[$v]+="$(python3 -c 'import json,sys; j=json.loads(sys.argv[1] or "{}"); print(round(j.get("decode_tps", 0), 1))' "$j") "
  done
done
for v in "${variants[@]}"; do
  python3 - "$v" "${dec[$v]}" <<'PY'
import statistics, sys
xs = [float(x) for x in sys.argv[2].split()]
print(f"{sys.argv[1]}: decode tok/s {xs} median {statistics.median(xs):.1f}")
PY
done
