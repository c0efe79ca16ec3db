"""Goldens for bit-exact affine quantization: MLX's `mx.quantize` (mode "affine", CPU
stream) on seeded matrices for bits {2,3,4,5,6,8} × group {32,64,128} × input dtype
{float32, float16, bfloat16}. (MLX's affine mode rejects group 16.)

Run from the repository root (needs numpy, safetensors, mlx >= 0.32):

    python3 tools/oracle/mlx_quantize.py

Writes crates/engine/tests/goldens/mlx_quantize.safetensors with, per dtype `<dt>`:
`<dt>.w` f32 [ROWS, COLS] (the input, converted exactly from <dt> to f32), and per case
`<dt>.b<bits>.g<group>.` + `packed` u32 [ROWS, COLS·bits/32] (MLX's packing viewed as
little-endian u32 words; for 3/5/6 bits MLX packs bytes, which is the same bit stream),
`scales` / `biases` holding the raw bits of <dt> (u16 for f16/bf16, u32 for f32).
Deterministic: a fixed seed.
"""

import os

import mlx.core as mx
import numpy as np
from safetensors.numpy import save_file

SEED = 7
ROWS, COLS = 8, 256
OUT = "crates/engine/tests/goldens/mlx_quantize.safetensors"
DTYPES = {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}


def make_input(rng):
    """Rows that reach every branch of the rule: signed and one-sided groups, constant and
    all-zero groups (scale falls to eps, q0 = 0), tie-heavy grids (rint's half-to-even),
    and magnitudes from 1e-4 to 1e2."""
    w = np.empty((ROWS, COLS), dtype=np.float32)
    w[0] = rng.normal(0, 0.02, COLS)
    w[1] = rng.uniform(0.1, 0.9, COLS)  # all positive: min edge far from zero
    w[2] = -rng.uniform(0.0, 3.0, COLS)  # all non-positive
    w[3] = rng.normal(0, 1, COLS) * 10.0 ** rng.uniform(-4, 2, COLS)  # heavy tails
    w[4] = rng.integers(-8, 8, COLS) * 0.25  # exact grids: many exact .5 ties
    w[5] = rng.integers(-3, 4, COLS) * 0.125 + 0.0625
    w[6] = rng.normal(0, 1, COLS)
    w[6, 0:32] = 0.0  # all-zero group
    w[6, 32:64] = 1.5  # constant group
    w[6, 64:96] = -2.0**-10  # tiny constant
    w[7] = rng.standard_cauchy(COLS).clip(-100, 100)
    w[7, 128:160] = 0.0
    w[7, 130] = 1e-3  # one nonzero in a zero group
    return w


def raw_bits(a, dt):
    """MLX array of dtype dt → numpy array of its raw bit patterns."""
    if dt == "f32":
        return np.array(a.astype(mx.float32)).view(np.uint32)
    # bf16/f16 → exact f32 → top/whole 16 bits
    f = np.array(a.astype(mx.float32))
    if dt == "f16":
        return f.astype(np.float16).view(np.uint16)
    return (f.view(np.uint32) >> 16).astype(np.uint16)


def main():
    rng = np.random.default_rng(SEED)
    base = make_input(rng)
    tensors = {}
    with mx.stream(mx.cpu):
        for dt, mdt in DTYPES.items():
            w = mx.array(base).astype(mdt)
            tensors[f"{dt}.w"] = np.array(w.astype(mx.float32))
            for bits in (2, 3, 4, 5, 6, 8):
                for group in (32, 64, 128):
                    wq, scales, biases = mx.quantize(w, group_size=group, bits=bits, mode="affine")
                    mx.eval(wq, scales, biases)
                    assert wq.dtype == mx.uint32 and scales.dtype == mdt
                    key = f"{dt}.b{bits}.g{group}."
                    tensors[key + "packed"] = np.array(wq)
                    tensors[key + "scales"] = raw_bits(scales, dt)
                    tensors[key + "biases"] = raw_bits(biases, dt)
    save_file(tensors, OUT, metadata={"seed": str(SEED), "mlx": mx.__version__})
    print("wrote", OUT, os.path.getsize(OUT), "bytes")


if __name__ == "__main__":
    main()
