#!/usr/bin/env bash
# Where a decode step's time goes, per kernel, on a machine with an NVIDIA GPU and ncu:
#   bash scripts/gpu-profile.sh BIN_DIR MODEL [skip] [count]
# Runs `ferrolm bench --device cuda` under Nsight Compute (clocks left alone, graph nodes
# profiled one by one), skipping the first `skip` launches (prefill and warm-up; default
# 4000) and profiling the next `count` (default 400, a few decode steps), then prints
# tools/profile/ncu_table.py's table. The CSV is kept in $OUT (or /tmp) as ncu.csv.
set -euo pipefail
bin=${1:?binary directory}
model=${2:?model file or directory}
skip=${3:-4000}
count=${4:-400}
csv=${OUT:-/tmp}/ncu.csv
ncu --clock-control none --graph-profiling node --launch-skip "$skip" --launch-count "$count" --csv \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum \
  "$bin/ferrolm" bench --device cuda --model "$model" --prompt-tokens 512 --gen-tokens 48 --repeats 1 >"$csv"
python3 "$(dirname "$0")/../tools/profile/ncu_table.py" "$csv"
