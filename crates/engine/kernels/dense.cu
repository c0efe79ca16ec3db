// Dense bf16 weights (unquantized models): y[t, r] = Σ_k w[r, k]·x[t, k], one warp per row,
// 16-byte loads of weights and activations, f32 accumulation. CPU reference:
// backend/cpu/matmul.rs (dense_rows).
#include "common.cuh"

#define WARPS 4

template <bool OUT_F32>
__device__ __forceinline__ void dmv_body(const bf16_t* __restrict__ w, const bf16_t* __restrict__ x,
                                         void* __restrict__ out, int rows, int cols) {
    int lane = threadIdx.x & 31, row = blockIdx.x * WARPS + (threadIdx.x >> 5), t = blockIdx.y;
    if (row >= rows) return;
    const uint4* wr = reinterpret_cast<const uint4*>(w + (size_t)row * cols);
    const uint4* xr = reinterpret_cast<const uint4*>(x + (size_t)t * cols);
    float acc = 0.f;
    for (int c = lane; c < cols / 8; c += 32) {
        float a[8], b[8];
        unpack_bf16x8(wr[c], a);
        unpack_bf16x8(xr[c], b);
#pragma unroll
        for (int j = 0; j < 8; j++) acc = fmaf(a[j], b[j], acc);
    }
    acc = warp_sum(acc);
    if (lane == 0) {
        if (OUT_F32) reinterpret_cast<float*>(out)[(size_t)t * rows + row] = acc;
        else reinterpret_cast<bf16_t*>(out)[(size_t)t * rows + row] = f2bf(acc);
    }
}

// grid (ceil(rows / 4), m), block 128; cols a multiple of 8.
extern "C" __global__ void dmv(const bf16_t* w, const bf16_t* x, bf16_t* y, int rows, int cols) {
    dmv_body<false>(w, x, y, rows, cols);
}
extern "C" __global__ void dmv_f32(const bf16_t* w, const bf16_t* x, float* y, int rows, int cols) {
    dmv_body<true>(w, x, y, rows, cols);
}

// out[t, :] = w[tokens[t] − first, :] · scale as f32 (the residual stream), zeros where
// that row is not among the table's `count` (embed's tensor-parallel part).
extern "C" __global__ void dembed(const bf16_t* __restrict__ w, const int* __restrict__ tokens,
                                  float* __restrict__ out, int cols, float scale, int first, int count) {
    int t = tokens[blockIdx.x] - first;
    bool held = t >= 0 && t < count;
    const bf16_t* r = w + (size_t)(held ? t : 0) * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x)
        out[(size_t)blockIdx.x * cols + i] = held ? bf2f(r[i]) * scale : 0.0f;
}
