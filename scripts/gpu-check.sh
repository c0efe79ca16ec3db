#!/usr/bin/env bash
# GPU test suite and benchmarks, on a machine with an NVIDIA GPU and no Rust toolchain.
# Build the binaries elsewhere (x86-64) and bring them in BIN_DIR (default gpu-bin/):
#   bash scripts/gpu-stage.sh   (builds gpu-bin/ferrolm and gpu-bin/cuda_parity)
# The SmolLM2 GGUF must be in $FERROLM_HOME/models (default ~/.cache/ferrolm/models); the
# 1B shape is generated (SYNTHETIC weights) into $M1B. Peers, side by side in this run:
#   - PyTorch (torch + transformers): tools/peers/torch_bench.py, unless TORCH=0, and
#     tools/peers/cublas_gemm.py (dequantize + cuBLAS, the prefill design not taken);
#   - llama.cpp, when LLAMA_BENCH names a llama-bench binary (CUDA build, docs/peers.md)
#     and GGUF_PY a llama.cpp gguf-py directory: it runs on the SmolLM2 GGUF and on a
#     synthetic 1B-shape Q4_0 GGUF (tools/peers/synth_gguf.py) that ferrolm runs too.
# Prints a short table last; full logs go to $OUT (or /tmp) as gpu-check.log.
set -uo pipefail
bin=${1:-gpu-bin}
out=${OUT:-/tmp}
log=$out/gpu-check.log
here=$(cd "$(dirname "$0")/.." && pwd)
model=${FERROLM_HOME:-$HOME/.cache/ferrolm}/models/SmolLM2-135M-Instruct.Q4_1.gguf
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$log"
status=0
# Every kernel variant compiled up front on all cores (the tests would otherwise compile
# them one by one as they first use them).
"$bin/ferrolm" kernels 2>&1 | tee -a "$log" || status=1
echo "== parity tests" | tee -a "$log"
"$bin/cuda_parity" --test-threads=1 --nocapture >>"$log" 2>&1 || status=1
# The decode GEMV's other x path (bf16 x, f32 math) must stay correct too.
FERROLM_GEMV_XQ=0 "$bin/cuda_parity" --test-threads=1 --nocapture fused_decode matmuls_and_embeddings \
  smollm2_cuda_agrees >>"$log" 2>&1 || status=1
# And without the K-sliced down GEMV (two warps per row's chunks at 8192-wide rows).
FERROLM_GEMV_KS=0 "$bin/cuda_parity" --test-threads=1 --nocapture fused_decode \
  >>"$log" 2>&1 || status=1
# And without down's x staged by the SwiGLU launch, and without the head's fused argmax.
FERROLM_GEMV_STAGED=0 FERROLM_HEAD_ARGMAX=0 "$bin/cuda_parity" --test-threads=1 --nocapture fused_decode fused_layer_end \
  smollm2_cuda_agrees fed_greedy >>"$log" 2>&1 || status=1
# And both decode GEMV weight feeds (ring-fed by bulk copies, register tiles), whichever
# is the default.
for ring in 0 1; do
  FERROLM_GEMV_RING=$ring "$bin/cuda_parity" --test-threads=1 --nocapture fused_decode smollm2_cuda_agrees \
    >>"$log" 2>&1 || status=1
done
# The whole model through the decode megakernel, against the CPU.
FERROLM_MEGAKERNEL=1 "$bin/cuda_parity" --test-threads=1 --nocapture smollm2_cuda_agrees >>"$log" 2>&1 || status=1
# So must decode attention's split merge through global memory only (no clusters).
FERROLM_ATTN_CLUSTER=0 "$bin/cuda_parity" --test-threads=1 --nocapture rope_attention smollm2_cuda_agrees \
  >>"$log" 2>&1 || status=1
# And decode attention with several query heads of a GQA group per block (not the default).
FERROLM_ATTN_QB=4 "$bin/cuda_parity" --test-threads=1 --nocapture rope_attention smollm2_cuda_agrees \
  >>"$log" 2>&1 || status=1
# Top-k sampling with the device top-k (the default) must give the host sampler's text
# (FERROLM_CUDA_TOPK=0: read back the logits, select on the host) for the same seed.
gen() { "$bin/ferrolm" generate --device cuda --model "$model" --prompt "Once upon a time" --temperature 0.8 \
  --top-k 40 --top-p 0.95 --seed 7 -n 48 2>>"$log"; }
host=$(FERROLM_CUDA_TOPK=0 gen); dev=$(gen)
if [[ -n $host && "$host" == "$dev" ]]; then echo "device top-k sampling: same text as the host sampler" | tee -a "$log"
else echo "device top-k sampling DIFFERS: host [$host] device [$dev]" | tee -a "$log"; status=1; fi
grep -E "^test |rel err|argmax|greedy|test result|µs per launch" "$log" | grep -vE "rel err [0-9.]+e-0[4-9]" | tail -60
# The weight stream of a persistent kernel, alone (sync::weight_stream_probe; docs/perf.md, session 16).
grep -E "weight stream, |µs per token" "$log"
echo "== bench" | tee -a "$log"
m1b=${M1B:-/tmp/ferrolm-m1b}
[[ -f $m1b/config.json ]] || "$bin/ferrolm" convert --synthetic llama-3.2-1b --quantize 4 --output "$m1b" >>"$log" 2>&1 || status=1
gguf1b=${GGUF_1B:-/tmp/ferrolm-synthetic-1b-q4_0.gguf}
if [[ -n ${LLAMA_BENCH:-} && -n ${GGUF_PY:-} ]]; then
  PYTHONPATH=$GGUF_PY python3 "$here/tools/peers/synth_gguf.py" --tokenizer-from "$model" --output "$gguf1b" >>"$log" 2>&1 || status=1
fi
results=()
bench() { "$bin/ferrolm" bench --device cuda --json --repeats 5 "$@" 2>>"$log" || echo '{}'; }
results+=("ferrolm, SmolLM2-135M Q4_1|$(bench --model "$model")")
results+=("ferrolm, SmolLM2-135M Q4_1, depth 7424|$(bench --model "$model" --depth 7424)")
# Greedy steps not fed on the device (each waits for the host to read its token and stage
# the next): what feeding saves.
results+=("ferrolm, SmolLM2-135M Q4_1, steps not fed|$(FERROLM_CUDA_FEED=0 bench --model "$model")")
# What a sampled step costs (top-k 40 at temperature 0.8): host sampling from read-back
# logits (FERROLM_CUDA_TOPK=0), then the device top-k (the default).
results+=("ferrolm, SmolLM2-135M Q4_1, sampled top-k 40, host|$(FERROLM_CUDA_TOPK=0 bench --model "$model" --temperature 0.8 --top-k 40)")
results+=("ferrolm, SmolLM2-135M Q4_1, sampled top-k 40, device|$(bench --model "$model" --temperature 0.8 --top-k 40)")
results+=("ferrolm, 1B shape 4-bit g64 (synthetic)|$(bench --model "$m1b")")
results+=("ferrolm, 1B shape 4-bit g64 (synthetic), depth 8192|$(bench --model "$m1b" --depth 8192)")
results+=("ferrolm, 1B shape 4-bit g64 (synthetic), FERROLM_GEMV_RING=0|$(FERROLM_GEMV_RING=0 bench --model "$m1b")")
results+=("ferrolm, 1B shape 4-bit g64 (synthetic), FERROLM_GEMV_RING=1|$(FERROLM_GEMV_RING=1 bench --model "$m1b")")
results+=("ferrolm, 1B shape 4-bit g64 (synthetic), steps not fed|$(FERROLM_CUDA_FEED=0 bench --model "$m1b")")
# Fed greedy steps one graph per step instead of runs of 8 in one graph.
results+=("ferrolm, 1B shape 4-bit g64 (synthetic), FERROLM_FEED_STEPS=1|$(FERROLM_FEED_STEPS=1 bench --model "$m1b")")
# Every bench repeat is a new session: without the pool each one captures its own steps.
results+=("ferrolm, 1B shape 4-bit g64 (synthetic), FERROLM_SESSION_POOL=0|$(FERROLM_SESSION_POOL=0 bench --model "$m1b")")
# The fused layer end (not the default until measured): the MLP as one launch, then o + MLP,
# then the MLP split along the FFN dimension in clusters (3).
for fused in 1 2 3; do
  results+=("ferrolm, 1B shape 4-bit g64 (synthetic), FERROLM_FFN_FUSED=$fused|$(FERROLM_FFN_FUSED=$fused bench --model "$m1b")")
  results+=("ferrolm, SmolLM2-135M Q4_1, FERROLM_FFN_FUSED=$fused|$(FERROLM_FFN_FUSED=$fused bench --model "$model")")
done
# The decode megakernel (every layer in one launch; not the default until measured faster).
results+=("ferrolm, 1B shape 4-bit g64 (synthetic), FERROLM_MEGAKERNEL=1|$(FERROLM_MEGAKERNEL=1 bench --model "$m1b")")
results+=("ferrolm, 1B shape 4-bit g64 (synthetic), depth 8192, FERROLM_MEGAKERNEL=1|$(FERROLM_MEGAKERNEL=1 bench --model "$m1b" --depth 8192)")
results+=("ferrolm, SmolLM2-135M Q4_1, FERROLM_MEGAKERNEL=1|$(FERROLM_MEGAKERNEL=1 bench --model "$model")")
results+=("ferrolm, 1B shape (synthetic), sampled top-k 40, host|$(FERROLM_CUDA_TOPK=0 bench --model "$m1b" --temperature 0.8 --top-k 40)")
results+=("ferrolm, 1B shape (synthetic), sampled top-k 40, device|$(bench --model "$m1b" --temperature 0.8 --top-k 40)")
if [[ -f $gguf1b ]]; then
  results+=("ferrolm, 1B shape Q4_0 GGUF (synthetic)|$(bench --model "$gguf1b")")
  results+=("ferrolm, 1B shape Q4_0 GGUF (synthetic), depth 8192|$(bench --model "$gguf1b" --depth 8192)")
fi
# Where a 1B decode step's time goes, launch by launch (a traced run: kernels record their
# start, pdl_wait release and end; tools/profile/trace_table.py folds the layers).
FERROLM_TRACE=/tmp/ferrolm-trace-1b.bin "$bin/ferrolm" bench --device cuda --model "$m1b" --repeats 1 >>"$log" 2>&1 || status=1
python3 "$here/tools/profile/trace_table.py" /tmp/ferrolm-trace-1b.bin 2>&1 | tee -a "$log" || status=1
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
  for m in "$model" "$gguf1b"; do
    [[ -f $m ]] || continue
    python3 - "$(basename "$m")" "$(lb "$m" -p 512 -n 128 -r 5)" "$(lb "$m" -p 0 -n 128 -d 8192 -r 3)" <<'PY'
import json, statistics, sys
for js in sys.argv[2:]:
    for t in json.loads(js):
        what = f"pp{t['n_prompt']}" if t["n_prompt"] else f"tg{t['n_gen']} at depth {t.get('n_depth', 0)}"
        print(f"llama.cpp CUDA, {sys.argv[1]}, {what}: median {statistics.median(t['samples_ts']):.1f} tok/s {t['samples_ts']}")
PY
  done
fi
# Prefill's other design, dequantize per layer then cuBLAS (PyTorch), at the GEMM shapes
# the qgemm test times.
grep -E "^q4 g64 m512" "$log"
python3 "$here/tools/peers/cublas_gemm.py" 2>>"$log" | sed 's/^/dequantize + cuBLAS: /'
# The PyTorch peer last (torch.compile takes a minute per shape; TORCH=0 skips it).
[[ ${TORCH:-1} == 0 ]] || for shape in smollm2-135m llama-3.2-1b; do
  echo "PyTorch bf16 $shape (random weights): $(timeout 240 python3 "$here/tools/peers/torch_bench.py" --shape $shape 2>>"$log" | tail -1)"
done
exit $status
