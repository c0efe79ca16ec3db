#!/usr/bin/env bash
# Parcels for the GPU machine, after scripts/gpu-stage.sh: gpu-bin/p1, p2, ... each under a
# device call's 64 MiB (with the working tree, measured here), so that every call that does work also
# carries the next piece of the models, and nothing waits on a call of its own:
#   p1: the binaries (ferrolm, cuda_parity, timings when staged), the tokenizer GGUF, the
#       kernels archive (KERNEL_CACHE=1; in a last parcel of its own where p1 would pass a
#       call's limit with it, which gpu-unpack.sh takes at any point), gpu-bin/peer/* when
#       present (llama.cpp's source, docs/peers.md), then the first bytes of the models;
#   p2...: the rest of the models (SmolLM2, then Gemma 3 270M) in order.
# The models travel as one byte stream with a manifest (name, offset, size, sha256); on the
# machine, `bash scripts/gpu-unpack.sh gpu-bin/pN` in each call (carry [gpu-bin/pN]) copies
# what the parcel holds to /root/gb and $FERROLM_HOME (default /root/fh), appends its piece,
# and writes each model to $FERROLM_HOME/models once its bytes are all there (checked).
# Calls must follow each other within ~30 s (the machine keeps /root while it is warm).
# Every parcel leaves TREE_ALLOWANCE (8 MiB) for the working tree, whatever its size today,
# so that parcels cut before a commit still fit and still join after it (a cut that moved
# with the tree's size once made a second pack's pieces misalign with a first's).
#   usage: scripts/gpu-pack.sh        env: PIECE (bytes per later parcel, default 64 MiB
#                                     less the allowance and 1 MiB)
set -euo pipefail
cd "$(dirname "$0")/../gpu-bin"
models=${FERROLM_HOME:-$HOME/.cache/ferrolm}/models
rm -rf p[0-9]*
mkdir -p p1
for f in ferrolm cuda_parity timings; do [[ -f $f ]] && cp "$f" p1/; done
cp tok/*.gguf p1/tok.gguf
[[ -f m2/kernels.tar.xz ]] && cp m2/kernels.tar.xz p1/
[[ -d peer ]] && cp -r peer p1/peer
python3 - "$models" "${PIECE:-$(((64 - 8 - 1) << 20))}" <<'PY'
import hashlib, json, os, sys
models, piece = sys.argv[1], int(sys.argv[2])
allowance = 8 << 20
names = ["SmolLM2-135M-Instruct.Q4_1.gguf", "gemma-3-270m-q4_k_m.gguf"]
blob, manifest = b"", []
for n in names:
    data = open(os.path.join(models, n), "rb").read()
    manifest.append({"name": n, "offset": len(blob), "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    blob += data
budget = (64 << 20) - allowance - (1 << 20)
used = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk("p1") for f in fs)
# A kernel archive that would push p1 past a call's limit travels in a last parcel of its own.
archive_apart = used > budget and os.path.exists("p1/kernels.tar.xz")
if archive_apart:
    used -= os.path.getsize("p1/kernels.tar.xz")
    os.replace("p1/kernels.tar.xz", "kernels-apart.tar.xz")
if used > budget:
    sys.exit(f"p1's binaries and files take {used} bytes, past a parcel's {budget}")
# A call carries the working tree too (tracked and untracked files git does not ignore).
import subprocess
tree = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd="..",
                      capture_output=True, check=True).stdout.split(b"\0")
tree_bytes = sum(os.path.getsize(os.path.join("..", f.decode())) for f in tree if f and os.path.isfile(os.path.join("..", f.decode())))
if tree_bytes > allowance:
    sys.exit(f"the working tree is {tree_bytes} bytes, past the parcels' allowance of {allowance}")
if piece > budget:
    sys.exit(f"PIECE {piece} leaves no room for the working tree")
first = max(0, budget - used)
cuts = [blob[:first]] + [blob[i:i + piece] for i in range(first, len(blob), piece)]
if archive_apart:
    cuts.append(b"")
    os.makedirs(f"p{len(cuts)}", exist_ok=True)
    os.replace("kernels-apart.tar.xz", f"p{len(cuts)}/kernels.tar.xz")
for i, c in enumerate(cuts, 1):
    os.makedirs(f"p{i}", exist_ok=True)
    open(f"p{i}/piece", "wb").write(c)
    json.dump({"index": i, "parcels": len(cuts), "files": manifest}, open(f"p{i}/manifest.json", "w"))
print(f"{len(cuts)} parcels:", " ".join(f"p{i} {sum(os.path.getsize(os.path.join(f'p{i}', f)) for f in os.listdir(f'p{i}') if os.path.isfile(os.path.join(f'p{i}', f))) / 1e6:.1f} MB" for i in range(1, len(cuts) + 1)))
PY
