#!/usr/bin/env bash
# A/B of variants in one GPU call: prefill and decode tok/s of `ferrolm bench` for the
# built-in kernels and default config and for each variant, in alternating rounds so that
# drift of the machine hits every variant alike. A variant is a directory
# (FERROLM_KERNEL_DIR: its .cu/.cuh files replace the built-in ones of the same name) or
# environment settings `VAR=VALUE[,VAR=VALUE…]` (config knobs, docs/knobs.md). Prints one
# row per variant with each round's tok/s and their medians.
#   usage: scripts/lab/gpu-ab.sh BIN_DIR MODEL ROUNDS [VARIANT_DIR ...]
#   env:   BENCH_ARGS (default "--repeats 3"): the timed runs' bench arguments
# A run that fails counts as 0 tok/s (its stderr is not kept; the warm-up's is shown).
# The variants compile on first use (NVRTC), outside the timed runs: one untimed
# `bench --repeats 1 --gen-tokens 8` per variant first, with BENCH_ARGS' other arguments (its
# --kv and --depth: the kernels the timed runs take).
set -uo pipefail
bin=$1 model=$2 rounds=$3
shift 3
variants=(builtin "$@")
run() {  # variant, then bench arguments
  local v=$1
  shift
  local settings=()
  if [[ $v == *=* ]]; then IFS=, read -ra settings <<<"$v"
  elif [[ $v != builtin ]]; then settings=("FERROLM_KERNEL_DIR=$v"); fi
  env "${settings[@]}" "$bin/ferrolm" bench --device cuda --json --model "$model" "$@"
}
read -ra timed <<<"${BENCH_ARGS:-}"
warm=()
for ((k = 0; k < ${#timed[@]}; k++)); do
  case ${timed[k]} in
    --repeats | --gen-tokens) k=$((k + 1)) ;;
    *) warm+=("${timed[k]}") ;;
  esac
done
for v in "${variants[@]}"; do
  run "$v" "${warm[@]}" --repeats 1 --gen-tokens 8 >/dev/null 2>/tmp/gpu-ab.err || { echo "warm-up of $v failed:"; tail -3 /tmp/gpu-ab.err; }
done
declare -A dec pre
tps() { python3 -c 'import json,sys; j=json.loads(sys.argv[1] or "{}"); print(round(j.get(sys.argv[2], 0), 1))' "$j" "$1"; }
for ((i = 0; i < rounds; i++)); do
  for v in "${variants[@]}"; do
    # shellcheck disable=SC2086
    j=$(run "$v" ${BENCH_ARGS:---repeats 3} 2>/dev/null) || j='{}'
    dec[$v]+="$(tps decode_tps) "
    pre[$v]+="$(tps prefill_tps) "
    echo "round $((i + 1)) $v: decode $(tps decode_tps)"  # as it goes: a timeout keeps what ran
  done
done
for v in "${variants[@]}"; do
  python3 - "$v" "${dec[$v]}" "${pre[$v]}" <<'PY'
import statistics, sys
d, p = ([float(x) for x in a.split()] for a in sys.argv[2:4])
print(f"{sys.argv[1]}: decode tok/s {d} median {statistics.median(d):.1f}; "
      f"prefill tok/s {p} median {statistics.median(p):.0f}")
PY
done
