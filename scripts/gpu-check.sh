#!/usr/bin/env bash
# GPU parity suite and the headline benchmarks, on a machine with an NVIDIA GPU and no Rust
# toolchain. Build the binaries elsewhere (x86-64) and bring them in BIN_DIR (default
# gpu-bin/): `bash scripts/gpu-stage.sh` (its header gives the device calls). The SmolLM2
# and Gemma 3 270M GGUFs must be in $FERROLM_HOME/models (default ~/.cache/ferrolm/models).
#   usage: scripts/gpu-check.sh [BIN_DIR]
#   env:   LLAMA_BENCH  a llama.cpp CUDA llama-bench (docs/peers.md): run side by side
#          GGUF_PY      llama.cpp's gguf-py directory, for tools/peers/synth_gguf.py (or the
#                       `gguf` package installed); without either, no 1B/8B Q4_0 GGUFs
#          OUT          where gpu-check.log goes (default /tmp)
#          PARITY=0 / BENCH=0   skip the parity suite / the benchmarks
#          PARITY_ARGS  arguments for the test binary, e.g. a filter or `--skip models::`
# The parity suite alone takes ~3 minutes on an H200 (2026-12-05: the model tests 118 s,
# the rest 59 s, after `ferrolm kernels` below); with the benchmarks, run it in two calls,
# PARITY_ARGS="--skip models" BENCH=0 then PARITY_ARGS=models (with the benchmarks).
# Parity: the whole GPU test target (every CudaConfig switch included, as a test), then the
# device top-k sampler against the host's. Benchmarks: SmolLM2-135M Q4_1, Gemma 3 270M
# Q4_K_M, and synthetic
# Llama-3.2-1B and Llama-3.1-8B shapes as Q4_0 GGUFs both engines load, each at depth 0 and
# 8192 (SmolLM2: 7424, its context less the run).
# Prints the parity lines and one table last; the full log goes to $OUT/gpu-check.log.
set -uo pipefail
bin=${1:-gpu-bin}
out=${OUT:-/tmp}
log=$out/gpu-check.log
here=$(cd "$(dirname "$0")/.." && pwd)
model=${FERROLM_HOME:-$HOME/.cache/ferrolm}/models/SmolLM2-135M-Instruct.Q4_1.gguf
gemma=$(dirname "$model")/gemma-3-270m-q4_k_m.gguf
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$log"
status=0
# NCCL for the tensor-parallel tests, loaded at run time as libnccl.so: PyTorch's wheel
# ships libnccl.so.2, which cudarc does not look for by that name, so a link to it.
nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
if [[ -n $nccl && -e $nccl/libnccl.so.2 ]]; then
    mkdir -p "$out/nccl-lib" && ln -sf "$nccl/libnccl.so.2" "$out/nccl-lib/libnccl.so"
    export LD_LIBRARY_PATH="$out/nccl-lib:$nccl${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
# Every kernel variant compiled up front on all cores (cached in $FERROLM_HOME/kernels).
"$bin/ferrolm" kernels 2>&1 | tee -a "$log" || status=1
if [[ ${PARITY:-1} != 0 ]]; then
echo "== parity tests" | tee -a "$log"
# shellcheck disable=SC2086 # PARITY_ARGS is a word list
"$bin/cuda_parity" --test-threads=1 --nocapture ${PARITY_ARGS:-} >>"$log" 2>&1 || status=1
# Top-k sampling on the device (the default) must give the host sampler's text
# (FERROLM_CUDA_TOPK=0: read back the logits, select on the host) for the same seed.
gen() { "$bin/ferrolm" generate --device cuda --model "$model" --prompt "Once upon a time" --temperature 0.8 \
  --top-k 40 --top-p 0.95 --seed 7 -n 48 2>>"$log"; }
host=$(FERROLM_CUDA_TOPK=0 gen); dev=$(gen)
if [[ -n $host && "$host" == "$dev" ]]; then echo "device top-k sampling: same text as the host sampler" | tee -a "$log"
else echo "device top-k sampling DIFFERS: host [$host] device [$dev]" | tee -a "$log"; status=1; fi
grep -E "^test |argmax|greedy|test result" "$log" | tail -60
fi
[[ ${BENCH:-1} == 0 ]] && exit $status
echo "== bench" | tee -a "$log"
ggufs=()
gguf_ok() { PYTHONPATH=${GGUF_PY:-} python3 -c 'import gguf' 2>/dev/null; }
for shape in llama-3.2-1b llama-3.1-8b; do
  g=/tmp/ferrolm-synthetic-$shape-q4_0.gguf
  if [[ ! -f $g ]] && gguf_ok; then
    PYTHONPATH=${GGUF_PY:-} python3 "$here/tools/peers/synth_gguf.py" --tokenizer-from "$model" --shape $shape \
      --output "$g" >>"$log" 2>&1 || status=1
  fi
  [[ -f $g ]] && ggufs+=("$g")
done
results=()
bench() { "$bin/ferrolm" bench --device cuda --json --repeats 5 "$@" 2>>"$log" || echo '{}'; }
results+=("ferrolm, SmolLM2-135M Q4_1|$(bench --model "$model")")
results+=("ferrolm, SmolLM2-135M Q4_1, depth 7424|$(bench --model "$model" --depth 7424 --prompt-tokens 512)")
results+=("ferrolm, Gemma 3 270M Q4_K_M|$(bench --model "$gemma")")
results+=("ferrolm, Gemma 3 270M Q4_K_M, depth 8192|$(bench --model "$gemma" --depth 8192)")
for g in "${ggufs[@]}"; do
  name=$(basename "$g" .gguf)
  results+=("ferrolm, $name|$(bench --model "$g")")
  results+=("ferrolm, $name, depth 8192|$(bench --model "$g" --depth 8192)")
done
python3 - "${results[@]}" <<'PY'
import json, sys
print("| run | prefill tok/s | decode tok/s | decode weight bandwidth | of copy bandwidth | load / first token |")
print("|---|---|---|---|---|---|")
for arg in sys.argv[1:]:
    name, _, js = arg.partition("|")
    try:
        j = json.loads(js)
        bw, r = j.get("effective_bandwidth_bytes_per_s"), j.get("bandwidth_ratio")
        cells = [f"{j['prefill_tps']:.0f}", f"{j['decode_tps']:.1f}"]
        cells += [f"{bw / 1e12:.3f} TB/s", f"{100 * r:.1f}% of {j['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s"] if bw and r else ["–", "–"]
        cells += [f"{j['load_seconds']:.2f} s / {j['first_token_seconds']:.2f} s"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    except Exception as e:
        print(f"| {name} | failed: {e!r} | | | | |")
PY
if [[ -n ${LLAMA_BENCH:-} ]]; then
  lb() { "$LLAMA_BENCH" -m "$1" -ngl 99 -fa 1 "${@:2}" -o json 2>>"$log" || echo '[]'; }
  for m in "$model" "$gemma" "${ggufs[@]}"; do
    python3 - "$(basename "$m")" "$(lb "$m" -p 512 -n 128 -r 5)" "$(lb "$m" -p 0 -n 128 -d 8192 -r 3)" <<'PY'
import json, statistics, sys
for js in sys.argv[2:]:
    for t in json.loads(js):
        what = f"pp{t['n_prompt']}" if t["n_prompt"] else f"tg{t['n_gen']} at depth {t.get('n_depth', 0)}"
        print(f"llama.cpp CUDA, {sys.argv[1]}, {what}: median {statistics.median(t['samples_ts']):.1f} tok/s")
PY
  done
fi
exit $status
