#!/usr/bin/env bash
# Two builds of ferrolm side by side in one GPU call: prefill and decode tok/s of
# `ferrolm bench` for BIN_A/ferrolm and BIN_B/ferrolm on each model, in alternating rounds so
# that drift of the machine hits both alike. One row per (model, depth, build): each round's
# numbers and their medians, then B/A.
#   usage: scripts/lab/gpu-ab-bins.sh BIN_A BIN_B ROUNDS MODEL[@DEPTH] ...
#   env:   BENCH_ARGS (default "--repeats 3")
# Each build compiles its kernels on first use (NVRTC), outside the timed runs: one untimed
# `bench --gen-tokens 8` per build and model first.
set -uo pipefail
a=$1 b=$2 rounds=$3
shift 3
run() {  # bin, model, depth, extra bench arguments
  local bin=$1 m=$2 d=$3
  shift 3
  # shellcheck disable=SC2086
  "$bin/ferrolm" bench --device cuda --json --model "$m" --depth "$d" "$@" 2>/dev/null || echo '{}'
}
for spec in "$@"; do
  m=${spec%@*} d=0
  [[ $spec == *@* ]] && d=${spec##*@}
  for bin in "$a" "$b"; do run "$bin" "$m" "$d" --repeats 1 --gen-tokens 8 >/dev/null; done
  declare -A res=()
  for ((i = 0; i < rounds; i++)); do
    for bin in "$a" "$b"; do
      # shellcheck disable=SC2086
      res[$bin]+="$(run "$bin" "$m" "$d" ${BENCH_ARGS:---repeats 3})"$'\n'
    done
  done
  python3 - "$(basename "$m")@$d" "$a" "${res[$a]}" "$b" "${res[$b]}" <<'PY'
import json, statistics, sys
name, a, ra, b, rb = sys.argv[1:6]
med = {}
for bin, rows in ((a, ra), (b, rb)):
    js = [json.loads(l) for l in rows.splitlines() if l.strip()]
    pre = [round(j.get("prefill_tps", 0)) for j in js]
    dec = [round(j.get("decode_tps", 0), 1) for j in js]
    med[bin] = (statistics.median(pre), statistics.median(dec))
    print(f"{name} {bin}: prefill {pre} median {med[bin][0]:.0f}; decode {dec} median {med[bin][1]:.1f}")
pa, da = med[a]
pb, db = med[b]
print(f"{name} B/A: prefill {pb / pa if pa else 0:.3f}, decode {db / da if da else 0:.3f}")
PY
  unset res
done
