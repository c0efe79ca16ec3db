#!/usr/bin/env bash
# On the GPU machine: take one parcel of scripts/gpu-pack.sh (its header says how).
#   usage: bash scripts/gpu-unpack.sh gpu-bin/pN
#   env:   GPU_ROOT (default /root): where the binaries (gb/), the stream and peer/ go;
#          FERROLM_HOME (default $GPU_ROOT/fh)
# Parcels with bytes of the models go in order; the kernel archive's parcel (no such bytes)
# may go at any point, e.g. second, so that the suite but `models::` runs before the models
# are all there.
# A checksum mismatch means the machine holds pieces of another pack: remove
# $GPU_ROOT/blob and $GPU_ROOT/blob.parcels and unpack again from p1 (p1, when no record
# says it was taken, starts the stream afresh by itself).
set -euo pipefail
p=${1:?usage: gpu-unpack.sh gpu-bin/pN}
root=${GPU_ROOT:-/root}
home=${FERROLM_HOME:-$root/fh}
mkdir -p "$home/models" "$root/gb"
for f in ferrolm cuda_parity timings; do [[ -f $p/$f ]] && cp "$p/$f" "$root/gb/"; done
[[ -f $p/tok.gguf ]] && cp "$p/tok.gguf" "$home/tok.gguf"
[[ -f $p/kernels.tar.xz ]] && tar -xJf "$p/kernels.tar.xz" -C "$home"
[[ -d $p/peer ]] && mkdir -p "$root/peer" && cp -r "$p"/peer/* "$root/peer/"
python3 - "$p" "$home" "$root" <<'PY'
import hashlib, json, os, sys
p, home, root = sys.argv[1:4]
m = json.load(open(os.path.join(p, "manifest.json")))
blob, done = os.path.join(root, "blob"), os.path.join(root, "blob.parcels")
have = open(done).read().split() if os.path.exists(done) else []
# Parcel 1 not yet taken starts the stream afresh: a machine once held bytes of another
# pack with no record of them (a fresh lease, Session 61), which misaligned every model.
if m["index"] == 1 and "1" not in have and os.path.getsize(os.path.join(p, "piece")) > 0:
    for f in (blob, done):
        if os.path.exists(f):
            os.remove(f)
    have = []
# A parcel with no bytes of the models (the kernel archive's own) may come at any time.
if os.path.getsize(os.path.join(p, "piece")) > 0 and str(m["index"]) not in have:
    if len(have) + 1 != m["index"]:
        sys.exit(f"parcel {m['index']} out of order: have {have}")
    with open(blob, "ab") as f:
        f.write(open(os.path.join(p, "piece"), "rb").read())
    open(done, "a").write(f"{m['index']}\n")
size = os.path.getsize(blob) if os.path.exists(blob) else 0
for f in m["files"]:
    out = os.path.join(home, "models", f["name"])
    if os.path.exists(out) or f["offset"] + f["size"] > size:
        continue
    with open(blob, "rb") as b:
        b.seek(f["offset"])
        data = b.read(f["size"])
    if hashlib.sha256(data).hexdigest() != f["sha256"]:
        sys.exit(f"{f['name']}: checksum mismatch")
    open(out + ".tmp", "wb").write(data)
    os.replace(out + ".tmp", out)
    print(f"{f['name']}: complete ({f['size']} bytes)")
print(f"parcel {m['index']} of {m['parcels']}: {size} bytes of the models here")
PY
