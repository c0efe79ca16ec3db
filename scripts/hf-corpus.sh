#!/usr/bin/env bash
# ferrolm against Transformers on model directories Transformers 5's own save_pretrained
# writes (tools/oracle/hf_corpus.py): SmolLM2-135M (Llama) and Gemma 3 270M loaded by
# Transformers from their GGUFs (dequantized to f32), and small random-weight Qwen3, Qwen2
# (q/k/v biases) and Gemma 3 (a sliding window of 32) models (synthetic) built from a
# Transformers config with a fixed seed; each saved as float32 and bfloat16, with tied and
# untied embeddings, sharded (small max_shard_size: model.safetensors.index.json) and with
# RoPE scalings in Transformers 5's `rope_parameters`. Then the teacher-forced NLL of the golden prose text
# from Transformers (float32 on the CPU, a bf16 directory's weights widened on load) and
# from ferrolm (`perplexity --json`) on each directory. Passes when, on every directory,
# mean |ΔNLL| ≤ 0.01 nats and the argmax agrees on ≥ 99% of the positions whose
# Transformers top-2 margin > 0.05. Needs pip torch "transformers>=5" gguf accelerate
# (installed if missing; PYTHON picks the interpreter, default python3). ~6 minutes on 2 cores.
#   usage: scripts/hf-corpus.sh [CASE...]   (tools/oracle/hf_corpus.py list; default all)
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
$py -c 'import torch, gguf, accelerate, transformers, sys; sys.exit(int(transformers.__version__.split(".")[0]) < 5)' \
  2>/dev/null || $py -m pip install --quiet torch "transformers>=5" gguf accelerate
cargo build --release -q -p ferrolm-cli
bin=${CARGO_TARGET_DIR:-target}/release/ferrolm
scripts/fetch-test-models.sh
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
$py -c '
import json, sys
g = json.load(open("crates/engine/tests/goldens/smollm2_hf.json"))
open(sys.argv[1], "w").write(next(t for t in g["texts"] if t["name"] == "prose")["text"])' "$tmp/prose.txt"
cases=("$@")
[[ ${#cases[@]} -gt 0 ]] || mapfile -t cases < <($py tools/oracle/hf_corpus.py list)
# One line per directory written: its shards and the config fields a loader must read.
$py tools/oracle/hf_corpus.py build "$tmp" "$tmp/prose.txt" "${cases[@]}" 2>"$tmp/log" || { cat "$tmp/log"; exit 1; }
for c in "${cases[@]}"; do
  $bin perplexity --model "$tmp/$c" --file "$tmp/prose.txt" --ctx 4096 --json >"$tmp/$c.ours.json"
done
$py tools/oracle/hf_corpus.py check "$tmp" "${cases[@]}"
