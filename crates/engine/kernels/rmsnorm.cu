// RMSNorm, one block per row: out = x · rsqrt(mean(x²) + eps) · w. bf16 in/out, f32 math.
// CPU reference: backend/cpu/ops.rs rms_norm.
#include "common.cuh"

extern "C" __global__ void rmsnorm(const bf16_t* __restrict__ x, const float* __restrict__ w,
                                   bf16_t* __restrict__ out, int cols, float eps) {
    __shared__ float red[32];
    const bf16_t* xr = x + (size_t)blockIdx.x * cols;
    bf16_t* orow = out + (size_t)blockIdx.x * cols;
    float ss = 0.f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        float v = bf2f(xr[i]);
        ss += v * v;
    }
    float r = rsqrtf(block_sum(ss, red) / cols + eps);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) orow[i] = f2bf(w[i] * (bf2f(xr[i]) * r));
}
