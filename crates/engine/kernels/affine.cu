// Affine-quantized weights (MLX layout: each row a LSB-first bit stream of BITS-bit q in
// u32 words, scale/bias per GROUP values along the row; w = scale·q + bias).
// Compiled per (BITS ∈ {2,4,8}, GROUP, SCALE_T) with -D defines.
//
// qmv: decode GEMV y[t, r] = Σ_k w[r, k]·x[t, k]. One warp per output row; each lane
// streams 16-byte weight chunks (32 values at 4 bits), converts x 8 values per 16-byte
// load, and folds the affine form once per group: scale·Σq·x + bias·Σx. f32 accumulation.
// CPU reference: backend/cpu/matmul.rs.
#define TRACE_FILE 4
#include "common.cuh"
#include "affine.cuh"

#define VPC (128 / BITS)                      // values per 16-byte chunk
#define SUBG (VPC > GROUP ? GROUP : VPC)      // values per group segment inside a chunk
#define WARPS 4

// TOK activation rows per block-y: each 16-byte weight chunk is loaded once and used for
// TOK rows (prefill reads the weights m/TOK times instead of m times).
template <bool OUT_F32, int TOK>
__device__ __forceinline__ void qmv_body(const u32* __restrict__ w, const scale_t* __restrict__ scales,
                                         const scale_t* __restrict__ biases, const bf16_t* __restrict__ x,
                                         void* __restrict__ out, int rows, int cols, int m) {
    int lane = threadIdx.x & 31;
    int row = blockIdx.x * WARPS + (threadIdx.x >> 5);
    int t0 = blockIdx.y * TOK;
    if (row >= rows) return;
    int nt = min(TOK, m - t0);
    int chunks = cols / VPC, groups = cols / GROUP;
    const uint4* wrow = reinterpret_cast<const uint4*>(w + (size_t)row * (cols / (32 / BITS)));
    const scale_t* sr = scales + (size_t)row * groups;
    const scale_t* br = biases + (size_t)row * groups;
    float acc[TOK];
#pragma unroll
    for (int t = 0; t < TOK; t++) acc[t] = 0.f;
    for (int c = lane; c < chunks; c += 32) {
        uint4 q4 = wrow[c];
        u32 words[4] = {q4.x, q4.y, q4.z, q4.w};
        int v0 = c * VPC;
#pragma unroll
        for (int sg = 0; sg < VPC / SUBG; sg++) {
            int g = (v0 + sg * SUBG) / GROUP;
            float sc = s2f(sr[g]), bi = s2f(br[g]);
#pragma unroll
            for (int t = 0; t < TOK; t++) {
                if (t < nt) {
                    const bf16_t* xr = x + (size_t)(t0 + t) * cols + v0 + sg * SUBG;
                    float dot = 0.f, sx = 0.f;
#pragma unroll
                    for (int i8 = 0; i8 < SUBG; i8 += 8) {
                        float xf[8];
                        load_bf16x8(xr + i8, xf);
#pragma unroll
                        for (int j = 0; j < 8; j++) {
                            int i = sg * SUBG + i8 + j;  // value index inside the chunk
                            float q = (float)((words[(i * BITS) / 32] >> ((i * BITS) % 32)) & MASK);
                            dot = fmaf(q, xf[j], dot);
                            sx += xf[j];
                        }
                    }
                    acc[t] = fmaf(sc, dot, fmaf(bi, sx, acc[t]));
                }
            }
        }
    }
#pragma unroll
    for (int t = 0; t < TOK; t++) {
        float a = warp_sum(acc[t]);
        if (lane == 0 && t < nt) {
            size_t o = (size_t)(t0 + t) * rows + row;
            if (OUT_F32) reinterpret_cast<float*>(out)[o] = a;
            else reinterpret_cast<bf16_t*>(out)[o] = f2bf(a);
        }
    }
}

// grid (ceil(rows / 4), m), block 128: one activation row per block-y (decode).
extern "C" __global__ void qmv(const u32* w, const scale_t* s, const scale_t* b, const bf16_t* x, bf16_t* y,
                               int rows, int cols, int m) {
    qmv_body<false, 1>(w, s, b, x, y, rows, cols, m);
}
extern "C" __global__ void qmv_f32(const u32* w, const scale_t* s, const scale_t* b, const bf16_t* x, float* y,
                                   int rows, int cols, int m) {
    qmv_body<true, 1>(w, s, b, x, y, rows, cols, m);
}
// grid (ceil(rows / 4), ceil(m / 8)), block 128: eight activation rows per block-y (prefill).
extern "C" __global__ void qmv8(const u32* w, const scale_t* s, const scale_t* b, const bf16_t* x, bf16_t* y,
                                int rows, int cols, int m) {
    qmv_body<false, 8>(w, s, b, x, y, rows, cols, m);
}
extern "C" __global__ void qmv8_f32(const u32* w, const scale_t* s, const scale_t* b, const bf16_t* x, float* y,
                                    int rows, int cols, int m) {
    qmv_body<true, 8>(w, s, b, x, y, rows, cols, m);
}

// out[t, :] = dequantized row tokens[t] − first of the table · scale (f32: the residual
// stream; scale is Gemma's √hidden, 1 elsewhere), zeros where that row is not among the
// table's `count` (a tensor-parallel rank's part of the vocabulary: the ranks' rows are
// then summed).
// grid m, block 256. Each thread takes whole u32 words of the row (32/BITS values, within
// one group: GROUP is a multiple), so a row of up to 256 words (2048 values at 4 bits)
// is one round of loads: decode's first launch is on the step's critical path, and the
// loop of one value per thread per round it replaced was 8 dependent rounds (4.2 µs of
// a 1B step; trace, docs/perf-log.md).
extern "C" __global__ void embed(const u32* __restrict__ w, const scale_t* __restrict__ scales,
                                 const scale_t* __restrict__ biases, const int* __restrict__ tokens,
                                 float* __restrict__ out, int cols, float scale, int first, int count) {
    TRACE_KERNEL();
    // A decode step's first kernel. Launched with PDL: in a run of fed steps captured as
    // one graph (generate.rs) the previous kernel is the last step's head, whose argmax
    // writes the token read here, so wait for it; and nothing of this step may start
    // before that step has ended (decode attention reads the position before its own
    // wait), so trigger only then. The first layer's q/k/v GEMV may then start and load
    // its weights while the row is gathered; it waits for our writes.
    pdl_wait();
    pdl_trigger();
    constexpr int VPW = 32 / BITS;  // values per word
    int r = tokens[blockIdx.x] - first;
    if (r < 0 || r >= count) {
        for (int i = threadIdx.x; i < cols; i += blockDim.x) out[(size_t)blockIdx.x * cols + i] = 0.0f;
        return;
    }
    int words = cols / VPW, groups = cols / GROUP;
    const u32* wr = w + (size_t)r * words;
    float4* o = reinterpret_cast<float4*>(out + (size_t)blockIdx.x * cols);
#pragma unroll 2
    for (int i = threadIdx.x; i < words; i += blockDim.x) {
        u32 q = wr[i];
        int g = i * VPW / GROUP;
        float sc = s2f(scales[(size_t)r * groups + g]), bi = s2f(biases[(size_t)r * groups + g]);
#pragma unroll
        for (int j = 0; j < VPW; j += 4) {
            float4 v;
            v.x = (sc * (float)((q >> ((j + 0) * BITS)) & MASK) + bi) * scale;
            v.y = (sc * (float)((q >> ((j + 1) * BITS)) & MASK) + bi) * scale;
            v.z = (sc * (float)((q >> ((j + 2) * BITS)) & MASK) + bi) * scale;
            v.w = (sc * (float)((q >> ((j + 3) * BITS)) & MASK) + bi) * scale;
            o[(i * VPW + j) / 4] = v;
        }
    }
}
