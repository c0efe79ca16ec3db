// The arithmetic every quantized GEMM kernel shares (gemm.cu's tiled kernel and
// gemm_small.cuh's few-token one), so that an output element has the same bits whichever
// kernel computed it, whatever the number of tokens in the call:
//   - a weight is dequantized in f32 as fmaf(scale, q, bias) and rounded once to bf16 (round
//     to nearest even);
//   - K is walked in chunks of CHUNK_K values; inside a chunk, the element's sum is a chain
//     of mma.m16n8k16 (bf16 in, f32 accumulate) over its k16 steps in order, from zero;
//     steps past cols (up to the next multiple of 64) run on zeros, as the tiled kernel's
//     last 64-wide step does;
//   - the chunks' sums are added in chunk order into an f32 total that starts at zero.
// An mma's output element depends only on its own row of A, column of B and accumulator, so
// the other tokens of the call (and padding) change nothing.
#pragma once

#define CHUNK_K 256  // k values per chunk
#define KSTEP_ALIGN 64  // the k16 steps run up to cols rounded up to this

// q (0..255) as an exact f32: 2^23 + q has q in its low mantissa bits.
__device__ __forceinline__ float q2f(u32 q) { return __uint_as_float(0x4b000000u | q) - 8388608.f; }

// Two quantized values of one scale group as a bf16x2 B-fragment register (q0 in the low half).
__device__ __forceinline__ u32 dequant_pair(u32 q0, u32 q1, float scale, float bias) {
    return pack_bf16x2(fmaf(scale, q2f(q0), bias), fmaf(scale, q2f(q1), bias));
}

// The gated MLP's output from gate's and up's f32 sums: act 0 silu, 1 gelu (tanh).
__device__ __forceinline__ float glu_value(float gate, float up, int act) {
    return (act ? gelu_tanh(gate) : silu(gate)) * up;
}
