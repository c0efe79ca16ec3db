#!/usr/bin/env bash
# The KV cache quality table of docs/kv.md: `ferrolm kl` of every cache scheme against the
# bf16 cache, teacher-forced over each file of tools/corpus/ (prose and code apart), at
# each context, then one markdown table (the JSON reports stay in $OUT).
#   usage: scripts/kv-quality.sh [MODEL]   (default: ferrolm's default model, SmolLM2)
#   env:   CTXS     contexts (default "512 4096")
#          DEVICE   cpu or cuda (default auto)
#          FERROLM  the binary (default target/release/ferrolm)
#          SCHEMES  comma-separated (default the table's nine less bf16, the base)
#          OUT      where the reports go (default /tmp/kv-quality)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${FERROLM:-target/release/ferrolm}
out=${OUT:-/tmp/kv-quality}
schemes=${SCHEMES:-affine:8,affine:4,turbo:k8v8,turbo:k8v4,turbo:k8v3,turbo:k8v2,turbo:k4v3,turbo:k4v2}
model=(); [[ -n ${1:-} ]] && model=(--model "$1")
mkdir -p "$out"
for f in tools/corpus/*.txt tools/corpus/*.c; do
  for ctx in ${CTXS:-512 4096}; do
    r=$out/$(basename "$f")-$ctx.json
    [[ -s $r ]] || "$bin" kl "${model[@]}" --device "${DEVICE:-auto}" --file "$f" --ctx "$ctx" --kv "$schemes" --json >"$r"
  done
done
# Bytes a cached token takes in each scheme (and bf16), from inspect.
sizes=$out/sizes.json
echo "{" >"$sizes"
for s in bf16 ${schemes//,/ }; do
  "$bin" inspect ${1:+"$1"} --kv "$s" --json |
    python3 -c 'import json,sys; k=json.load(sys.stdin)["kv"]; print(json.dumps(k["scheme"]) + ":", k["bytes_per_position"], ",")' >>"$sizes"
done
echo '"": 0}' >>"$sizes"
python3 - "$out" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
sizes = json.load(open(os.path.join(out, "sizes.json")))
print("| scheme | bytes/token (vs bf16) | file | ctx | KL mean | KL p99 | KL max | same top token | ppl change |")
print("|---|---|---|---|---|---|---|---|---|")
for path in sorted(glob.glob(os.path.join(out, "*.json"))):
    name = os.path.basename(path)
    if name == "sizes.json":
        continue
    file, ctx = name[:-5].rsplit("-", 1)
    reports = json.load(open(path))
    for r in reports if isinstance(reports, list) else [reports]:
        s = r["scheme"]
        print(f"| {s} | {sizes[s]} ({sizes['bf16'] / sizes[s]:.2f}x) | {file} | {ctx} | {r['kl_mean']:.5f} | "
              f"{r['kl_p99']:.4f} | {r['kl_max']:.3f} | {100 * r['top1_agreement']:.2f}% | "
              f"{100 * (r['ppl'] / r['ppl_base'] - 1):+.2f}% |")
PY
